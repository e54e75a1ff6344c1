"""The ``yr.InvokeOptions``, ``yr.Config`` and ``ResourceGroupOptions`` dataclasses: each field's
spec, the rules between fields, and the checks that validate them (how a spec is checked is
``yrdask/field_specs.py``'s)."""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from yrdask.affinity import Affinity
from yrdask.errors import YRTypeError, YRValueError
from yrdask.field_specs import (ANY, DICT, LIST, STR, STR_DICT, STR_LIST, NoneType, Spec,
                                bool_spec, check_value, copy_containers, int_spec,
                                is_instance_of, reject_unsupported, show, spec_field,
                                unsupported, validate_fields)

__all__ = ["InvokeOptions", "Config", "ResourceGroupOptions", "check_invoke_options", "check_return_nums", "check_config",
           "check_no_unknown"]

_INT32_MAX = 0x7FFFFFFF

#: How much of a node's ``accelerator_type:<model>`` (1 per node) a request for that model
#: takes: any request fits, so the tag only chooses nodes (Ray's rule).
ACCELERATOR_SHARE = 0.001


def gpu_resource(key: str, amount: float) -> dict[str, float]:
    """yr's GPU and NPU keys in the ledger's terms: ``"GPU/.+/count"`` (any model) is
    ``GPU``; ``"GPU/H200/count"`` is ``GPU`` on a node whose GPUs are H200s
    (``accelerator_type:H200``, docs/nodes.md); ``"NPU/.+/count"`` and
    ``"NPU/Ascend910B/count"`` likewise for ``NPU``.  Other keys are returned as they are."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] in ("GPU", "NPU") and parts[2] == "count":
        kind, model = parts[0], parts[1]
        if model in (".+", ".*", "*", ""):
            return {kind: amount}
        return {kind: amount, f"accelerator_type:{model}": ACCELERATOR_SHARE}
    return {key: amount}


def _check_node_resources(v: dict) -> str | None:
    for reserved, fld in (("CPU", "num_cpus"), ("GPU", "num_gpus"), ("Memory", "")):
        if reserved in v:
            return (f"not contain {reserved!r}; set Config.{fld} instead" if fld else
                    f"not contain {reserved!r}: workers offer their memory limit")
    negative = [k for k, amount in v.items() if isinstance(amount, bool) or amount < 0]
    if negative:
        return f"hold amounts >= 0 (key {negative[0]!r})"
    if "NPU" in v and v["NPU"] != int(v["NPU"]):
        return "declare a whole number of NPUs ('NPU' is a count of devices)"
    return None


def _check_custom_resources(v: dict) -> str | None:
    for reserved, fld in (("CPU", "cpu (millicores)"), ("Memory", "memory (MB)")):
        if reserved in v:
            return f"not contain {reserved!r}; set InvokeOptions.{fld} instead"
    negative = [k for k, amount in v.items() if amount < 0]
    if negative:
        return f"hold amounts >= 0 (key {negative[0]!r} is negative)"
    return None


_RUNTIME_ENV_KEYS = ("env_vars", "working_dir")


def _check_runtime_env(v: dict) -> str | None:
    """Only the keys yrdask honours (in an isolated process); packages are never installed."""
    for key, value in v.items():
        if key not in _RUNTIME_ENV_KEYS:
            return (f"not contain {key!r}: yrdask does not install packages or environments; "
                    "install them on every worker host beforehand (supported keys: "
                    "'env_vars', 'working_dir')")
    env = v.get("env_vars", {})
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(x, str) for k, x in env.items()):
        return f"have 'env_vars' as a dict[str, str], got {show(env)}"
    if not isinstance(v.get("working_dir", ""), str):
        return f"have 'working_dir' as a str, got {show(v['working_dir'])}"
    return None


#: custom_extensions keys yrdask honours: allowed values, or None for a whole number of seconds.
_EXTENSIONS: dict[str, tuple[str, ...] | None] = {
    "lifecycle": ("detached",),  # the instance outlives its job (detached)
    "GRACEFUL_SHUTDOWN_TIME": None,  # seconds __yr_shutdown__(grace) may take on terminate
}


def _check_custom_extensions(v: dict) -> str | None:
    for key, value in v.items():
        if key not in _EXTENSIONS:
            return (f"not contain {key!r}: yrdask honours only "
                    '"lifecycle": "detached" (detached instances) and "GRACEFUL_SHUTDOWN_TIME" '
                    "(seconds for __yr_shutdown__); use the matching InvokeOptions field for "
                    "the rest (e.g. concurrency=)")
        allowed = _EXTENSIONS[key]
        if allowed is None:
            if isinstance(value, bool) or not str(value).isdigit():
                return f"map {key!r} to a whole number of seconds >= 0 (got {value!r})"
        elif value not in allowed:
            return f"map {key!r} to one of {allowed} (got {value!r})"
    return None


def _check_recycle_time(v: int) -> str | None:
    return None if 0 < v <= 300 else "be in (0, 300] seconds"


def _check_security(v: Any) -> str | None:
    if v is None:
        return None
    from distributed.security import Security

    return None if isinstance(v, Security) else "be None or a distributed.security.Security"


def _check_logger(v: Any) -> str | None:
    return None if v is None or isinstance(v, logging.Logger) else "be None or a logging.Logger"


# --------------------------------------------------------------------------- InvokeOptions


def _limit_rule(limit: str, base: str) -> Callable[["InvokeOptions"], str | None]:
    def rule(o: "InvokeOptions") -> str | None:
        lim, val = getattr(o, limit), getattr(o, base)
        return None if lim == 0 or lim >= val else f"be 0 or >= {base} ({val})"

    return rule


def _need_order_rule(o: "InvokeOptions") -> str | None:
    if o.need_order is True and o.concurrency is not None and o.concurrency > 1:
        return f"not be True with concurrency={o.concurrency} (ordered calls run one at a time)"
    return None


def _get_if_exists_rule(o: "InvokeOptions") -> str | None:
    if o.get_if_exists and not o.name:
        return "be False when name is empty (get_if_exists looks an instance up by name)"
    return None


def _light_rule(o: "InvokeOptions") -> str | None:
    if o.light is not True:
        return None
    renv = o.runtime_env or {}
    devices = any(k for k, v in o.custom_resources.items()
                  if v and ({"GPU", "NPU"} & set(gpu_resource(k, 1.0))))
    asks = [what for what, on in (("isolated=True", o.isolated), ("env_vars", o.env_vars),
                                  ("runtime_env", renv.get("env_vars") or renv.get("working_dir")),
                                  ("GPUs or NPUs", devices))
            if on]
    if asks:
        return (f"not be True with {' and '.join(asks)}: a light instance shares its worker's "
                "process, and these need a process of its own; drop one of them")
    return None


# Rules spanning several fields: (field the message names, rule).
_CROSS_RULES: tuple[tuple[str, Callable[["InvokeOptions"], "str | None"]], ...] = (
    ("cpu_limit", _limit_rule("cpu_limit", "cpu")),
    ("mem_limit", _limit_rule("mem_limit", "memory")),
    ("need_order", _need_order_rule),
    ("get_if_exists", _get_if_exists_rule),
    ("light", _light_rule),
)

_CROSS_FIELDS = tuple(name for name, _ in _CROSS_RULES)

# Class attributes (not constructor arguments, as in yr) that are still checked when set.
_CLASS_FLAGS = ("preferred_priority", "required_priority", "preferred_anti_other_labels")


@dataclass
class ResourceGroupOptions:
    """Where a call runs inside a resource group: ``bundle_index`` -1 = any of its bundles.

    ``InvokeOptions(resource_group_options=ResourceGroupOptions("rg", 0))``; an empty
    ``resource_group_name`` means no group (yr's default).  See ``docs/resource-groups.md``.
    """

    resource_group_name: str = spec_field(STR, "")
    bundle_index: int = spec_field(int_spec(-1, note="-1 = any bundle"), -1)

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass
class InvokeOptions:
    """Per-call scheduling and lifecycle options of a task or instance, as in ``yr.InvokeOptions``."""

    # Each field is honoured (docs/options.md says how) or rejected when set (unsupported: why, and
    # what to use instead); tests/test_options_walk.py walks them all.
    cpu: int = spec_field(int_spec(0, note="millicores"), 500)
    memory: int = spec_field(int_spec(0, note="MB"), 500)
    cpu_limit: int = spec_field(unsupported(
        int_spec(0, note="millicores"), "a worker process does not cap the CPU one task uses",
        "use cpu= for the millicores reserved for the call"), 0)
    mem_limit: int = spec_field(unsupported(
        int_spec(0, note="MB"), "a worker process does not cap the memory one task uses",
        "use memory= for the MB reserved for the call"), 0)
    concurrency: int | None = spec_field(int_spec(1, 1000, none_ok=True), None)
    custom_resources: dict[str, float] = spec_field(
        Spec((dict,), "a dict[str, int | float]", keys=(str,), items=(int, float),
              check=_check_custom_resources),
        factory=dict,
    )
    custom_extensions: dict[str, str] = spec_field(
        Spec((dict,), "a dict[str, str | int]", keys=(str,), items=(str, int),
              check=_check_custom_extensions), factory=dict
    )
    pod_labels: dict[str, str] = spec_field(unsupported(
        STR_DICT, "Kubernetes pod labels have no meaning for Dask workers",
        "use labels=[...] for instance labels, or custom_resources={...} to target workers"),
        factory=dict)
    labels: list[str] = spec_field(STR_LIST, factory=list)
    affinity: dict[str, str] = spec_field(unsupported(
        DICT, "the deprecated affinity dict of openYuanrong",
        "use schedule_affinities=[yr.Affinity(...)]"), factory=dict)
    device: Any = spec_field(unsupported(
        ANY, "heterogeneous function devices are not modelled",
        'use custom_resources={"GPU": n} with workers started with --resources "GPU=n"'), None)
    max_invoke_latency: int = spec_field(unsupported(
        int_spec(-1, _INT32_MAX, note="ms"), "there is no function autoscaler to act on a latency goal",
        "size the cluster instead (Config(num_cpus=...) or more dask workers)"), 5000)
    min_instances: int = spec_field(unsupported(
        int_spec(0, _INT32_MAX), "stateless calls run on leased worker slots, not on a pool of "
        "function instances", "size the cluster instead (Config(num_cpus=...) or more dask workers)"),
        0)
    max_instances: int = spec_field(unsupported(
        int_spec(-1, _INT32_MAX), "stateless calls run on leased worker slots, not on a pool of "
        "function instances", "bound parallelism with yr.wait back-pressure or the cluster size"),
        0)
    recover_retry_times: int = spec_field(int_spec(-1, _INT32_MAX, note="restarts, -1 = unlimited"), 0)
    need_order: bool | None = spec_field(bool_spec(none_ok=True), None)
    name: str = spec_field(STR, "")
    namespace: str = spec_field(STR, "")
    schedule_affinities: list = spec_field(
        Spec((list,), "a list[yr.Affinity]", items=(Affinity,)), factory=list)
    is_data_affinity: bool = spec_field(bool_spec(), False)
    resource_group_options: Any = spec_field(Spec(
        (ResourceGroupOptions, NoneType), "None or a yr.ResourceGroupOptions"), None)
    function_group_options: Any = spec_field(unsupported(
        ANY, "function groups (gang-scheduled stateless functions) are not implemented",
        "use resource_group_options= to place calls in a resource group"), None)
    env_vars: dict[str, str] = spec_field(STR_DICT, factory=dict)
    retry_times: int = spec_field(int_spec(0, _INT32_MAX), 0)
    trace_id: str = spec_field(unsupported(
        STR, "yrdask has no distributed tracing to carry the id into",
        "pass the id as an argument of the call"), "")
    alias_params: dict[str, str] = spec_field(unsupported(
        DICT, "function aliases of openYuanrong's function service do not exist here",
        "call the function you mean directly"), factory=dict)
    runtime_env: dict = spec_field(Spec((dict,), "a dict", keys=(str,), check=_check_runtime_env),
                             factory=dict)
    debug: Any = spec_field(unsupported(
        ANY, "there is no remote debug server in workers",
        "debug the function locally, or log from it (Config(log_to_driver=True) shows its prints)"),
        None)
    preempted_allowed: bool = spec_field(unsupported(
        bool_spec(), "yrdask never preempts running work", "leave it False"), False)
    instance_priority: int = spec_field(unsupported(
        int_spec(), "requests are served in arrival order, there are no priorities",
        "leave it 0"), 0)
    schedule_timeout_ms: int = spec_field(int_spec(-1, note="ms, -1 = forever"), 30000)
    group_name: str = spec_field(STR, "")
    idle_timeout: int = spec_field(unsupported(
        int_spec(0, note="seconds"), "instances are not recycled when idle: one lives until it is "
        "terminated, released or its owner ends", "call handle.terminate() when done"), 300)
    is_delete_remote_tensor: bool = spec_field(unsupported(
        bool_spec(), "there is no device tensor transport", "leave it False"), False)
    bypass_datasystem: bool = spec_field(unsupported(
        bool_spec(), "there is no data system: values up to 512 KiB already travel inline with the "
        "call and larger ones stay on the worker that made them", "leave it False"), False)
    skip_serialize: bool = spec_field(unsupported(
        bool_spec(), "code is always shipped by pickling, nothing is pre-deployed",
        "leave it False"), False)
    port_forwardings: list = spec_field(unsupported(
        LIST, "sandbox port forwarding does not exist for Dask workers",
        "reach a service in a worker by its worker's host"), factory=list)
    get_if_exists: bool = spec_field(bool_spec(), False)
    # yrdask extension: host the instance in its own process (for native code that may
    # crash); env_vars and runtime_env env_vars/working_dir imply it.
    isolated: bool = spec_field(bool_spec(), False)
    # yrdask extension: True hosts the instance in a worker process it shares with other
    # light instances (fast, small; docs/isolation.md says what they share), False in a
    # process of its own; None: the job's default, the Dask key ``yrdask.instances.light``
    # (false unless set: a process of its own, as a yr instance or a Ray actor is).
    light: bool | None = spec_field(bool_spec(none_ok=True), None)

    # Plain class attributes, not dataclass fields: passing them to the constructor is a
    # TypeError, exactly as in yr.  They may still be set on an instance.
    preferred_priority = True
    required_priority = False
    preferred_anti_other_labels = False

    def __post_init__(self) -> None:
        # Each field's type and range is checked where the options are written, so a bad
        # value fails at that line.  Rules spanning fields wait for validate() (at
        # ``.options()`` and the decorators): yr code often sets fields one by one.  A field
        # yrdask does not support fails here too when set, unless a cross-field rule covers
        # it (cpu_limit, mem_limit): that rule's message comes first, at validate().
        validate_fields(self)
        reject_unsupported(self, skip=_CROSS_FIELDS)

    def validate(self) -> "InvokeOptions":
        """Check every option's type and range; raise YRTypeError / YRValueError naming the field.

        A field yrdask does not support, set to a non-default value, is a YRValueError that
        says what to use instead (docs/options.md).
        """
        validate_fields(self)
        for name in _CLASS_FLAGS:
            check_value("InvokeOptions", name, bool_spec(), getattr(self, name))
        for name, rule in _CROSS_RULES:
            problem = rule(self)
            if problem is not None:
                raise YRValueError(f"InvokeOptions.{name} must {problem}, got {show(getattr(self, name))}")
        reject_unsupported(self)
        return self

    def resource_shape(self) -> dict[str, float]:
        """The resources one call needs, keyed like Dask worker resources (zero entries dropped)."""
        shape = {"CPU": float(self.cpu), "Memory": float(self.memory)}
        for k, v in self.custom_resources.items():
            if v:
                for name, amount in gpu_resource(k, float(v)).items():
                    shape[name] = shape.get(name, 0.0) + amount
        return shape

    @property
    def is_detached(self) -> bool:
        """True when the instance outlives its job and creator (``lifecycle: detached``)."""
        return self.custom_extensions.get("lifecycle") == "detached"

    def copy(self) -> "InvokeOptions":
        """An independent copy: its dict and list fields can be mutated without touching self."""
        return copy_containers(self)


def check_invoke_options(opts: Any) -> InvokeOptions:
    """Check that ``opts`` is a valid InvokeOptions and return it."""
    if not isinstance(opts, InvokeOptions):
        raise YRTypeError(f"expected yr.InvokeOptions, got {type(opts).__name__}")
    return opts.validate()


def check_no_unknown(what: str, kwargs: dict, tolerated: tuple[str, ...] = ()) -> None:
    """``YRTypeError`` naming the keywords of ``kwargs`` a decorator does not know.

    openYuanrong silently ignores them, so a ``num_cpus=`` there quietly did nothing;
    ``tolerated`` are the ones yr documents as accepted and ignored.
    """
    unknown = [k for k in kwargs if k not in tolerated]
    if unknown:
        raise YRTypeError(
            f"{what} got unknown keyword argument(s) {', '.join(map(repr, unknown))}; "
            "resources and other options go in yr.InvokeOptions "
            "(e.g. invoke_options=yr.InvokeOptions(cpu=1000))")


def check_return_nums(n: Any, what: str = "return_nums") -> int:
    """Check a declared number of return values: an int in [0, 100]."""
    if not is_instance_of(n, (int,)):
        raise YRTypeError(f"{what} must be an int, got {show(n)} ({type(n).__name__})")
    if not 0 <= n <= 100:
        raise YRValueError(f"{what} must be in [0, 100], got {n!r}")
    return n


# --------------------------------------------------------------------------- Config


# Reasons and replacements shared by several rejected Config fields.
_DEPLOYED = "functions are not deployed by id: yrdask ships code by pickling it with the call"
_PICKLED = "decorate the function or class with @yr.invoke / @yr.instance and call .invoke()"
_NO_DS = ("there is no separate data system: objects live with their owner or the worker "
          "that made them")
_CODE = "workers import code from their own sys.path; nothing is loaded from the driver's paths"
_CODE_INSTEAD = ("use working_dir= or InvokeOptions(runtime_env={\"working_dir\": ...}), or "
                 "install the code on the workers (PYTHONPATH of dask worker)")
_HTTP = "there is no HTTP client to tune: drivers talk to Dask over its comms"
_DASK_COMM = "set Dask's distributed.comm.* configuration (e.g. distributed.comm.timeouts.connect)"
_TLS = "use security=distributed.security.Security(...) or enable_tls with the *_path fields"
_IAM = "there is no multi-tenant identity service"
_LOGS = "yrdask writes no log files of its own: it logs to the Python logger 'yrdask'"
_LOGS_INSTEAD = "pass logger= (a logging.Logger that gets yrdask's records) or configure logging"


@dataclass
class Config:
    """Settings for ``yr.init``: where the cluster is, logging, timeouts and defaults for the job."""

    # Each field is honoured (docs/options.md says how) or rejected when set (unsupported: why, and
    # what to use instead); tests/test_options_walk.py walks them all.
    function_id: str = spec_field(unsupported(STR, _DEPLOYED, _PICKLED), "")
    cpp_function_id: str = spec_field(unsupported(STR, _DEPLOYED, _PICKLED), "")
    cpp_auto_function_name: str = spec_field(unsupported(STR, _DEPLOYED, _PICKLED), "")
    function_name: str = spec_field(unsupported(STR, _DEPLOYED, _PICKLED), "")
    server_address: str = spec_field(STR, "")
    ds_address: str = spec_field(unsupported(STR, _NO_DS, "join the cluster with server_address= only"), "")
    is_driver: bool = spec_field(unsupported(
        bool_spec(), "only a driver calls yr.init; code in tasks and instances is initialised "
        "already", "do not call yr.init inside tasks"), True)
    log_level: str | int = spec_field(Spec((str, int), "a str or an int (log level)"), "")
    invoke_timeout: int = spec_field(unsupported(
        int_spec(1, note="seconds"), "there is no HTTP frontend whose reads it would bound",
        "pass timeout= to yr.get / yr.wait, and InvokeOptions(schedule_timeout_ms=...)"), 900)
    # local_mode: yr's single-process mode runs here on the embedded cluster (cluster semantics)
    local_mode: bool = spec_field(bool_spec(), False)
    code_dir: str = spec_field(unsupported(STR, _CODE, _CODE_INSTEAD), "")
    connection_nums: int = spec_field(unsupported(int_spec(1), _HTTP, _DASK_COMM), 100)
    recycle_time: int = spec_field(unsupported(
        Spec((int,), "an int (seconds)", check=_check_recycle_time),
        "stateless calls run on leases, which go back after 1 s idle, not on recycled instances",
        "leave it 2"), 2)
    in_cluster: bool | None = spec_field(unsupported(
        bool_spec(none_ok=True), "a driver always joins through the Dask scheduler",
        "give server_address="), None)
    job_id: str = spec_field(STR, "")
    tls_config: Any = spec_field(unsupported(ANY, "openYuanrong's TLS config object is not read", _TLS), None)
    auto: bool = spec_field(bool_spec(), False)
    deployment_config: Any = spec_field(unsupported(
        ANY, "the embedded cluster is sized by CPUs only",
        "use num_cpus= (its workers offer their memory limit)"), None)
    rt_server_address: str = spec_field(unsupported(STR, "there is no runtime server to reach",
                                      "give server_address= (the Dask scheduler)"), "")
    log_dir: str = spec_field(unsupported(STR, _LOGS, _LOGS_INSTEAD), "./")
    env_file: str = spec_field(STR, "")
    log_file_size_max: int = spec_field(unsupported(int_spec(0), _LOGS, _LOGS_INSTEAD), 0)
    log_file_num_max: int = spec_field(unsupported(int_spec(0), _LOGS, _LOGS_INSTEAD), 0)
    log_flush_interval: int = spec_field(unsupported(int_spec(0, note="seconds"), _LOGS, _LOGS_INSTEAD), 5)
    logger: logging.Logger | None = spec_field(Spec(None, "None or a logging.Logger", check=_check_logger), None)
    runtime_id: str = spec_field(unsupported(STR, "a driver has no runtime id but its job_id",
                               "use job_id="), "driver")
    max_task_instance_num: int = spec_field(unsupported(
        int_spec(-1, note="-1 = unlimited"), "stateless calls do not run on function instances",
        "size the cluster (num_cpus= or more dask workers)"), -1)
    load_paths: list = spec_field(unsupported(LIST, _CODE, _CODE_INSTEAD), factory=list)
    rpc_timeout: int = spec_field(unsupported(int_spec(1, note="seconds"), _HTTP, _DASK_COMM), 1800)
    enable_mtls: bool | None = spec_field(bool_spec(none_ok=True), None)
    enable_tls: bool | None = spec_field(bool_spec(none_ok=True), None)
    private_key_path: str = spec_field(STR, "")
    certificate_file_path: str = spec_field(STR, "")
    verify_file_path: str = spec_field(STR, "")
    private_key_paaswd: str = spec_field(unsupported(
        STR, "Dask loads TLS keys without a password",
        "give an unencrypted private_key_path"), "", repr=False)  # secret: kept out of repr
    server_name: str = spec_field(unsupported(STR, "Dask checks the scheduler's certificate against the CA, "
                                "not against a configured server name", _TLS), "")
    http_ioc_threads_num: int = spec_field(unsupported(int_spec(1), _HTTP, _DASK_COMM), 400)
    ns: str = spec_field(unsupported(STR, "a job-wide default namespace is not implemented",
                       "give InvokeOptions(namespace=...) and yr.get_instance(name, namespace=...)"),
                   "")
    tenant_id: str = spec_field(unsupported(STR, _IAM, _TLS), "")
    auth_token: str = spec_field(unsupported(STR, _IAM, _TLS), "", repr=False)  # secret: kept out of repr
    enable_metrics: bool = spec_field(unsupported(
        bool_spec(), "metrics are the scheduler's (Dask's /metrics and the yr dashboard pages), "
        "not the driver's", "leave it True; turn the dashboard off on the scheduler "
        "(dask scheduler --no-dashboard)"), True)
    bypass_datasystem: bool | None = spec_field(unsupported(
        bool_spec(none_ok=True), _NO_DS + ": values up to 512 KiB already travel inline",
        "leave it None"), None)
    custom_envs: dict[str, str] = spec_field(unsupported(
        STR_DICT, "worker processes are shared by every job and are not restarted per job",
        "use InvokeOptions(env_vars=...) or runtime_env={\"env_vars\": ...}: that work runs "
        "in its own process with them"), factory=dict)
    master_addr_list: list = spec_field(unsupported(LIST, "there are no master nodes",
                                      "give server_address= (the Dask scheduler)"), factory=list)
    working_dir: str = spec_field(STR, "")
    enable_ds_encrypt: bool = spec_field(unsupported(bool_spec(), _NO_DS, _TLS), False)
    ds_public_key_path: str = spec_field(unsupported(STR, _NO_DS, _TLS), "")
    runtime_public_key_path: str = spec_field(unsupported(STR, _NO_DS, _TLS), "")
    runtime_private_key_path: str = spec_field(unsupported(STR, _NO_DS, _TLS), "")
    num_cpus: int | None = spec_field(int_spec(0, none_ok=True), None)
    # yrdask extensions (Ray's ray.init(num_gpus=, resources=)): what the embedded cluster's
    # node offers besides its CPUs; GPUs declared here need no hardware (docs/nodes.md).
    num_gpus: int | None = spec_field(int_spec(0, none_ok=True), None)
    resources: dict = spec_field(Spec((dict,), "a dict[str, float]", keys=(str,),
                                 items=(int, float), check=_check_node_resources),
                           factory=dict)
    # Bytes of shared memory the node's object store may hold before it spills to disk
    # (docs/objects.md); None: the Dask key yrdask.object-store.memory, else 30 % of memory.
    object_store_memory: int | None = spec_field(int_spec(1, note="bytes", none_ok=True), None)
    runtime_env: dict | None = spec_field(unsupported(
        Spec((dict, NoneType), "None or a dict"), "a job-wide runtime environment is not "
        "implemented", "give InvokeOptions(runtime_env=...) to the functions and classes "
        "that need it"), None)
    log_to_driver: bool = spec_field(bool_spec(), False)
    dedup_logs: bool = spec_field(bool_spec(), True)
    # yrdask extension: the Dask TLS settings (a distributed.security.Security) used to
    # join a secure cluster; None for a plain-TCP cluster.
    security: object = spec_field(Spec(None, "None or a distributed.security.Security", check=_check_security), None)

    def __post_init__(self) -> None:
        validate_fields(self)  # a bad setting fails where it is written, not at yr.init
        reject_unsupported(self)

    def validate(self) -> "Config":
        """Check every setting's type and range; raise YRTypeError / YRValueError naming the field.

        A field yrdask does not support, set to a non-default value, is a YRValueError that
        says what to use instead (docs/options.md); so is a setting that would be ignored
        because of another one.
        """
        validate_fields(self)
        reject_unsupported(self)
        for name, rule in _CONFIG_RULES:
            problem = rule(self)
            if problem is not None:
                raise YRValueError(f"Config.{name} {problem}, got {show(getattr(self, name))}")
        return self

    def resolved(self) -> "Config":
        """A validated copy with unset fields filled from the environment and a fresh job id."""
        conf: Config = copy_containers(self)
        if not conf.server_address and not (conf.auto or conf.local_mode):
            conf.server_address = os.environ.get("YR_SERVER_ADDRESS", "")
        if conf.log_level == "":
            conf.log_level = os.environ.get("YR_LOG_LEVEL") or "WARNING"
        if not conf.job_id:
            conf.job_id = "job-" + uuid.uuid4().hex[:8]
        return conf.validate()


def _tls_paths_rule(field_name: str) -> Callable[[Config], "str | None"]:
    def rule(c: Config) -> str | None:
        if getattr(c, field_name) and not (c.enable_tls or c.enable_mtls):
            return "is read only when enable_tls=True (or enable_mtls=True): set one of them"
        return None

    return rule


def _embedded_rule(field_name: str) -> Callable[[Config], "str | None"]:
    def rule(c: Config) -> str | None:
        if getattr(c, field_name) and c.server_address:
            return ("starts an embedded cluster, which joining server_address contradicts: "
                    f"drop server_address (or {field_name})")
        return None

    return rule


# Rules spanning several Config fields: (field the message names, rule).
_CONFIG_RULES: tuple[tuple[str, Callable[[Config], "str | None"]], ...] = (
    *((name, _tls_paths_rule(name))
      for name in ("verify_file_path", "certificate_file_path", "private_key_path")),
    ("auto", _embedded_rule("auto")),
    ("local_mode", _embedded_rule("local_mode")),
)


def check_config(conf: Any) -> Config:
    """Turn the argument of ``yr.init`` into a resolved, validated Config (None means defaults)."""
    if conf is None:
        conf = Config()
    if not isinstance(conf, Config):
        raise YRTypeError(f"expected yr.Config, got {type(conf).__name__}")
    conf.validate()
    # Checked before YR_SERVER_ADDRESS fills server_address: a script sized for the embedded
    # cluster (num_cpus=6) still joins a cluster named by the environment.
    if conf.server_address and conf.num_cpus is not None:
        raise YRValueError(
            f"Config.num_cpus sizes only the embedded cluster, but server_address="
            f"{conf.server_address!r} joins an existing one (got num_cpus={conf.num_cpus}); "
            "drop one of them (the cluster's size is its dask workers')")
    for name in ("num_gpus", "resources"):
        if conf.server_address and getattr(conf, name):
            raise YRValueError(
                f"Config.{name} declares what the embedded cluster offers, but server_address="
                f"{conf.server_address!r} joins an existing one (got {name}="
                f"{getattr(conf, name)!r}); declare them on its workers instead (dask worker "
                f"--resources, or DASK_YRDASK__WORKER__GPUS) and drop {name}")
    return conf.resolved()
