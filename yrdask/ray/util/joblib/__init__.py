"""``ray.util.joblib``: ``register_ray()`` makes joblib's ``"ray"`` backend run on yrdask.

Importing this module does not import joblib; ``register_ray`` does, and says which package to
install when it is missing.
"""

from __future__ import annotations

__all__ = ["register_ray"]


def register_ray() -> None:
    """Register the joblib parallel backend ``"ray"``: ``with joblib.parallel_backend("ray"):``
    runs ``Parallel(n_jobs=...)`` (and scikit-learn's ``n_jobs``) on a Pool of actors."""
    try:
        from joblib import register_parallel_backend
    except ImportError as e:
        raise ImportError("ray.util.joblib.register_ray needs the 'joblib' package: "
                          "pip install joblib") from e
    from yrdask.ray.util.joblib.ray_backend import RayBackend

    register_parallel_backend("ray", RayBackend)
