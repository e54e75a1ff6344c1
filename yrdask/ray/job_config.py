"""``ray.job_config.JobConfig``: job-wide settings handed to ``ray.init(job_config=...)``.

yrdask honours ``runtime_env`` (``env_vars`` only, as ``ray.init(runtime_env=)``),
``ray_namespace`` (the job's namespace unless ``ray.init(namespace=)`` names one),
``default_actor_lifetime`` (actors that give no ``lifetime`` get this one) and
``code_search_path`` (directories the workers add to ``sys.path`` before they load the job's
tasks and actors, as Ray's Python workers get them in their ``PYTHONPATH``).  ``metadata`` and
``jvm_options`` are refused when set: yrdask keeps no job table to show metadata in and runs
no Java.
"""

from __future__ import annotations

from typing import Any

from yrdask.ray.exceptions import UnsupportedOptionError

__all__ = ["JobConfig"]


class JobConfig:
    """Job-wide settings (Ray's class and keywords; see the module doc for what is honoured)."""

    def __init__(self, jvm_options: list | None = None, code_search_path: list | None = None,
                 runtime_env: dict | None = None, _client_job: bool = False,
                 metadata: dict | None = None, ray_namespace: str | None = None,
                 default_actor_lifetime: str = "non_detached",
                 _py_driver_sys_path: list | None = None) -> None:
        for key, value in (("jvm_options", jvm_options), ("metadata", metadata)):
            if value:
                raise UnsupportedOptionError(
                    f"JobConfig({key}=...) is not supported by yrdask.ray: it keeps no job "
                    "table and runs no Java; leave it out")
        paths = code_search_path or []
        if not isinstance(paths, (list, tuple)) or not all(isinstance(p, str) for p in paths):
            raise TypeError(f"The type of code search path is incorrect: {type(paths)} "
                            "(a list of directory paths, str)")
        self.code_search_path = list(paths)
        self.runtime_env = runtime_env or {}
        self.metadata: dict = {}
        self.ray_namespace: str | None = None
        self.set_ray_namespace(ray_namespace)
        self.default_actor_lifetime = "non_detached"
        self.set_default_actor_lifetime(default_actor_lifetime)

    def set_runtime_env(self, runtime_env: dict | None, validate: bool = False) -> None:
        if runtime_env is not None and not isinstance(runtime_env, dict):
            raise TypeError(f"runtime_env must be a dict, got {type(runtime_env).__name__}")
        self.runtime_env = runtime_env or {}

    def set_ray_namespace(self, ray_namespace: str | None) -> None:
        if ray_namespace is not None and (not isinstance(ray_namespace, str)
                                          or not ray_namespace):
            raise TypeError(f"ray_namespace must be None or a non-empty str, "
                            f"got {ray_namespace!r}")
        self.ray_namespace = ray_namespace

    def set_default_actor_lifetime(self, default_actor_lifetime: str) -> None:
        if default_actor_lifetime not in ("detached", "non_detached"):
            raise ValueError("Default actor lifetime must be one of `detached`, "
                             f"`non_detached`, got {default_actor_lifetime!r}")
        self.default_actor_lifetime = default_actor_lifetime

    def set_metadata(self, key: str, value: str) -> None:
        raise UnsupportedOptionError("JobConfig.set_metadata is not supported by yrdask.ray: "
                                     "it keeps no job table to show metadata in")

    @classmethod
    def from_json(cls, job_config_json: dict) -> "JobConfig":
        """Ray's JSON form (``runtime_env``, ``ray_namespace``, ``default_actor_lifetime``...)."""
        return cls(**{k: v for k, v in dict(job_config_json).items()})

    def __repr__(self) -> str:
        return (f"JobConfig(runtime_env={self.runtime_env!r}, ray_namespace="
                f"{self.ray_namespace!r}, default_actor_lifetime={self.default_actor_lifetime!r}, "
                f"code_search_path={self.code_search_path!r})")


def _apply(job_config: Any) -> JobConfig:
    if not isinstance(job_config, JobConfig):
        raise TypeError(f"job_config must be a ray.job_config.JobConfig, got "
                        f"{type(job_config).__name__}")
    return job_config
