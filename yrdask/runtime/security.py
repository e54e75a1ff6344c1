"""The TLS settings a driver connects and listens with, from its ``Config`` or Dask's config."""

from __future__ import annotations

import os
from typing import Any

from yrdask.errors import YRValueError
from yrdask.field_specs import show
from yrdask.options import Config


# The client-side TLS files: openYuanrong's Config field, the Security attribute it fills and
# the Dask configuration key Security() reads when neither is given.
_TLS_FILES = (("verify_file_path", "tls_ca_file", "distributed.comm.tls.ca-file"),
              ("certificate_file_path", "tls_client_cert", "distributed.comm.tls.client.cert"),
              ("private_key_path", "tls_client_key", "distributed.comm.tls.client.key"))


def resolve_security(conf: Config) -> Any:
    """The ``distributed.security.Security`` a driver uses, its certificate files checked.

    From ``Config.security`` if set; else from openYuanrong's fields (``enable_tls`` or
    ``enable_mtls`` with ``verify_file_path``, ``certificate_file_path``, ``private_key_path``);
    else from Dask's configuration (``distributed.comm.tls.*``), which ``Security()`` reads.
    A file that does not exist or does not load raises ``YRValueError`` naming it.
    """
    from distributed.security import Security

    if conf.security is not None:
        sec, names = conf.security, {attr: f"Config.security.{attr}" for _, attr, _ in _TLS_FILES}
    elif conf.enable_tls or conf.enable_mtls:
        if conf.private_key_paaswd:
            raise YRValueError("Config.private_key_paaswd is not supported: Dask loads TLS keys "
                               "without a password; give an unencrypted private_key_path")
        for field_name, _, _ in _TLS_FILES:
            if not getattr(conf, field_name):
                raise YRValueError(f"Config.{field_name} must be set when enable_tls or "
                                   "enable_mtls is True (yrdask always uses mutual TLS)")
        sec = Security(require_encryption=True,
                       **{attr: getattr(conf, f) for f, attr, _ in _TLS_FILES})
        names = {attr: f"Config.{f}" for f, attr, _ in _TLS_FILES}
    else:
        sec, names = Security(), {attr: key for _, attr, key in _TLS_FILES}
    for _, attr, _ in _TLS_FILES:
        path = getattr(sec, attr, None)
        if isinstance(path, str) and path and "\n" not in path and not os.path.isfile(path):
            raise YRValueError(f"{names[attr]}: no such file {path!r}")
    try:  # the driver both connects and listens (its owner server) with the client's files
        sec.get_connection_args("client")
        sec.get_listen_args("client")
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        files = ", ".join(f"{names[attr]}={show(getattr(sec, attr, None), 60)}"
                          for _, attr, _ in _TLS_FILES)
        raise YRValueError(f"the TLS files do not load ({files}): {e}") from None
    except (AttributeError, TypeError) as e:  # a subclass that can only connect
        raise YRValueError(f"{type(sec).__name__} cannot make the TLS contexts a driver needs to "
                           f"connect and to listen ({e}); give a distributed.security.Security "
                           "built from the same CA, certificate and key") from None
    return sec
