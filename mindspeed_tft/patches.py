"""Every run-time patch of third-party code, declared in one table.

mindspeed-tft adapts torch, megatron-core, Megatron-LM's `megatron.training` and torchrun
at run time, the way MindSpeed adapts Megatron. Each change is declared below: the target
(``module:qualified.name``), why it is needed and the version it was written against. The
patches are grouped by the moment they are installed at; a moment's installer (a function
named in the table) changes exactly the targets listed for it, and runs only when the
process reaches that moment and calls `install(name)`: importing a module of this package
never patches anything.

Moments, in the order a training process meets them:

- ``stand-ins``: the Megatron-LM host adaptor, before Megatron-LM's imports, where a module
  megatron-core has cannot import here (`mindspeed_tft.stand_ins`: a module put in
  sys.modules and on its package, not an attribute swap);
- ``cpu``: the platform adaptor on a machine without an accelerator (`apply_platform_adaptor`);
- ``torch-adam``: megatron-core without Apex / Transformer Engine falls back to torch's Adam;
- ``update-bracket``: the trainer starts reporting its optimizer updates (SPEC 3);
- ``replica-optimizer``: the replica groups exist (`TFTPlugin.setup`);
- ``gloo-collectives``: high availability on gloo (`TFTPlugin.register`);
- ``data-loader-workers``: high availability, a launcher's stop is the training process's
  grace period (`TFTPlugin.register`);
- ``group-names``: the `mindio_ttp` API's `tft_init_processor` (sdk/), as Huawei's SDK;
- ``sdk-load-verify``: the same call, where Megatron-LM's checkpointing is imported
  (MindSpeed-LLM): its loads verify the dumps' manifests;
- ``megatron-lm`` / ``megatron-lm-cpu``: the Megatron-LM host adaptor
  (`mindspeed_tft.megatron.install`, the one-line import `mindspeed_tft.megatron_adaptor`);
- ``torchrun``: the torchrun hook (`scripts/patch_torchrun.sh`: worker reboot under plain
  torchrun; also the usage guide's `import mindio_ttp.framework_ttp` in the torchrun script,
  sdk/, which installs it in that program only).

Scoped swaps (a name replaced for the duration of a ``with`` block and put back) are listed
too, under the moment ``scoped``; they are made with `swapped`, which refuses a target the
table does not declare.

Each patch says which versions it applies to (`Fits`): torch 2.13, or a range of
megatron-core / Megatron-LM releases inside the supported one (0.12.1 to 0.16.1,
`mindspeed_tft.platform.megatron_version`; Megatron-LM's ``megatron/training`` is read at
the version of the ``megatron/core`` beside it). An installer changes exactly the targets
that apply to the megatron-core of its process (`applicable`). `tests/test_patches.py`
resolves every target against each pinned version it claims (megatron-core and Megatron-LM
core_v0.12.1 and core_v0.16.1) and checks that each installer changes exactly its targets
there.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Fits:
    """The releases of `library` a patch applies to: `low` to `high`, both included (for
    megatron-core and Megatron-LM, releases of megatron-core: a Megatron-LM tree is read at
    the version of its ``megatron/core``)."""

    library: str
    low: str
    high: str

    def __str__(self) -> str:
        return f"{self.library} {self.low}" + ("" if self.low == self.high else f" to {self.high}")

    @property
    def megatron(self) -> bool:
        """Whether the range is one of megatron-core releases (else: torch's)."""
        return self.library != "torch"

    def covers(self, megatron_core: Any) -> bool:
        """Whether a process on megatron-core `megatron_core` (a `packaging` Version) gets
        the patch: always for torch's, by the range for megatron-core's and Megatron-LM's."""
        from packaging.version import Version

        return not self.megatron or Version(self.low) <= megatron_core <= Version(self.high)


TORCH = Fits("torch", "2.13", "2.13")
#: megatron-core, the whole supported range / one end of it
MCORE = Fits("megatron-core", "0.12.1", "0.16.1")
MCORE_016 = Fits("megatron-core", "0.16.1", "0.16.1")
#: Megatron-LM's megatron/training and megatron/legacy, likewise
MLM = Fits("Megatron-LM", "0.12.1", "0.16.1")
VERSIONS = (TORCH, MCORE, MCORE_016, MLM)


@dataclass(frozen=True)
class Patch:
    """One replaced name: ``module:qualified.name``, why, and the versions it applies to."""

    target: str
    why: str
    version: Fits


@dataclass(frozen=True)
class Moment:
    """The patches installed together at one moment, by `installer` (``module:function``)."""

    name: str
    when: str
    installer: str | None
    patches: tuple[Patch, ...]


def _p(target: str, why: str, version: Fits) -> Patch:
    return Patch(target, why, version)


_CPU_DEVICE = "megatron-core places tensors on `torch.cuda.current_device()` / device='cuda'"
_CPU_TYPE = "compares `Tensor.type()` with 'torch.cuda.*Tensor' names: CPU tensors answer them"

TABLE: tuple[Moment, ...] = (
    Moment("stand-ins", "the Megatron-LM host adaptor is installed, before Megatron-LM's "
           "imports, where a module megatron-core has cannot import here", "mindspeed_tft.stand_ins:install", (
        _p("megatron.core.transformer.custom_layers:batch_invariant_kernels",
           "imports Triton at its top and Megatron-LM's initialize imports it (for "
           "--batch-invariant-mode only): without Triton (CPU), a stand-in module whose "
           "functions refuse naming the fix", MCORE_016),
    )),
    Moment("cpu", "platform adaptor on CPU", "mindspeed_tft.platform.cpu_adaptor:apply", (
        *(_p(f"torch:{name}", f"{_CPU_DEVICE}: a CUDA device argument means the CPU", TORCH)
          for name in ("tensor", "zeros", "ones", "empty", "full", "arange")),
        _p("torch:Tensor.cuda", "`.cuda()` returns the CPU tensor itself", TORCH),
        _p("torch.cuda:current_device", f"{_CPU_DEVICE}: the CPU device", TORCH),
        *(_p(f"torch.cuda:{name}", "CPU work is ordered by program order: no streams", TORCH)
          for name in ("Stream", "stream", "current_stream", "default_stream", "synchronize")),
        *(_p(f"torch.cuda:{name}", "the 'CUDA' generator is the CPU generator", TORCH)
          for name in ("get_rng_state", "set_rng_state", "manual_seed")),
        *(_p(f"megatron.core.tensor_parallel.random:{name}",
             "the model-parallel RNG tracker keeps CPU generator states", MCORE)
          for name in ("_get_cuda_rng_state", "_set_cuda_rng_state")),
        _p("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
           _CPU_TYPE, MCORE),
        _p("megatron.core.optimizer.distrib_optimizer:"
           "DistributedOptimizer._build_model_and_main_param_groups", _CPU_TYPE, MCORE),
        _p("megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
           _CPU_TYPE, MCORE),
        _p("megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32", _CPU_TYPE, MCORE),
        _p("megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32", _CPU_TYPE, MCORE),
        _p("megatron.core.optimizer.distrib_optimizer:quantize_param_shard",
           "raises without Transformer Engine even when there are no FP8 params", MCORE),
        _p("torch.distributed.distributed_c10d:ProcessGroupGloo",
           "each gloo group gets a transport device whose loop thread wakes every 10 ms "
           "(~0.8 ms of CPU per second per group and rank, ~20 groups): one device per "
           "process for all (`platform.gloo_device`)", TORCH),
    )),
    Moment("torch-adam", "megatron-core falls back to torch's Adam (no Apex, no TE)",
           "mindspeed_tft.platform.native_adam:apply", (
        _p("megatron.core.optimizer.distrib_optimizer:"
           "DistributedOptimizer._set_main_param_and_optimizer_states",
           "the checkpoint's parameter state has no `step`: keep the restored one", MCORE),
        _p("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict",
           "every param's state shares one `step` tensor after a load: give each its own",
           MCORE),
    )),
    Moment("update-bracket", "the trainer reports its optimizer updates (SPEC 3)",
           "mindspeed_tft.plugin.hooks:install_update_bracket", (
        *(_p(f"megatron.core.optimizer.optimizer:{cls}.step_with_ready_grads",
             "report 'start / end updating' around the local update, which never "
             "communicates", MCORE)
          for cls in ("MixedPrecisionOptimizer", "FP32Optimizer")),
    )),
    Moment("replica-optimizer", "the replica groups exist (N > 1 replicas)",
           "mindspeed_tft.replica.optimizer:install_patches", (
        _p("megatron.core.optimizer.distrib_optimizer:"
           "DistributedOptimizer.get_grad_stats_parallel_group",
           "with N replicas the world holds every shard N times: reduce grad norms over "
           "one replica instance", MCORE),
        _p("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.save_parameter_state",
           "DP rank 0 of every replica instance would write the same file: only instance 0",
           MCORE),
        _p("megatron.core.optimizer.optimizer:ChainedOptimizer.count_zeros",
           "counts the zeros of the N-times larger shard every step even without "
           "--log-num-zeros-in-grad (the count is dropped): only when asked", MCORE),
    )),
    Moment("gloo-collectives", "high availability on gloo",
           "mindspeed_tft.recovery.collectives:install_gloo_collectives", (
        _p("torch.distributed:all_reduce",
           "collected inside megatron-core's coalescing manager (gloo has none)", TORCH),
        *(_p(f"torch.distributed:{name}",
             "gloo's reduce-scatter waits ignore timeouts (not abandonable): an all-reduce "
             "(in place when the output is the buffer's own slice) and a slice", TORCH)
          for name in ("reduce_scatter_tensor", "_reduce_scatter_base")),
        *(_p(f"{module}:dist_reduce_scatter_func",
             "megatron-core's reduce-scatter, as the gloo stand-in", MCORE)
          for module in ("megatron.core.distributed.param_and_grad_buffer",
                         "megatron.core.tensor_parallel.mappings",
                         "megatron.core.tensor_parallel.layers")),
        _p("megatron.core.distributed.param_and_grad_buffer:dist_all_gather_func",
           "collected inside the coalescing manager", MCORE),
        _p("megatron.core.distributed.param_and_grad_buffer:_coalescing_manager",
           "gloo cannot coalesce: collect the operations and wait for them together", MCORE),
        _p("torch.distributed:Work.wait",
           "a rank stopped by the controller must leave a wait on a dead peer", TORCH),
        *(_p(f"{module}:{name}", "marked so the abandonable wait knows a p2p op (torch "
             "checks P2POp functions against distributed_c10d's names)", TORCH)
          for module in ("torch.distributed", "torch.distributed.distributed_c10d")
          for name in ("isend", "irecv", "batch_isend_irecv")),
        *(_p(f"torch.distributed:{name}", "blocking p2p through the abandonable wait", TORCH)
          for name in ("send", "recv")),
    )),
    Moment("data-loader-workers", "high availability: a launcher's stop is the training "
           "process's grace period (`TFTPlugin.register`)",
           "mindspeed_tft.launcher.lifetime:install_data_worker_signals", (
        _p("torch.utils.data._utils.signal_handling:_set_worker_signal_handlers",
           "a data-loader worker dies of the SIGTERM a launcher sends its worker's whole "
           "process group, and the training process's SIGCHLD handler then raises 'DataLoader "
           "worker (pid N) is killed by signal: Terminated' at an arbitrary point of a healthy "
           "rank's fault handling: the worker blocks SIGTERM first and leaves any but its "
           "parent's to the training process; it dies with its parent", TORCH),
    )),
    Moment("connection-tracking", "high availability, before the first process group",
           "mindspeed_tft.recovery.collectives:install_connection_tracking", (
        _p("torch.distributed.distributed_c10d:_new_process_group_helper",
           "record the sockets each process group creation opens (every init_process_group, "
           "new_group and rebuild goes through it), so a stop shuts down those only", TORCH),
        _p("megatron.core.parallel_state:initialize_model_parallel",
           "its dozens of groups tracked in one window (two socket listings, not two per "
           "group: the listings cost more than the groups)", MCORE),
    )),
    Moment("group-names", "mindio_ttp's tft_init_processor, as Huawei's SDK does there",
           "mindspeed_tft.recovery.group_names:install", (
        _p("torch.distributed.distributed_c10d:_process_group_name",
           "groups rebuilt after a repair on the same store would get old groups' names "
           "and store keys (destroy_process_group restarts the counter at 0): each name "
           "carries the repair's id, as the SDK's do", TORCH),
    )),
    Moment("sdk-load-verify", "mindio_ttp's tft_init_processor (MindSpeed-LLM), where "
           "Megatron-LM's checkpointing is imported",
           "mindspeed_tft.recovery.manifest:install_load_verify", (
        _p("megatron.training.checkpointing:_load_base_checkpoint",
           "MindSpeed-LLM loads through Megatron-LM's load_checkpoint, which reads every "
           "checkpoint through it: the tracker and the manifest the SDK wrote beside the "
           "dump are checked first (a bad one: exit 2, one line)", MLM),
    )),
    Moment("megatron-lm", "the Megatron-LM host adaptor is installed",
           "mindspeed_tft.megatron.adaptor:install_patches", (
        *(_p(f"{module}:parse_args", "add the mindspeed-tft flags to Megatron-LM's parser "
             "(pretrain_gpt.py passes no extra_args_provider)", MLM)
          for module in ("megatron.training.arguments", "megatron.training.initialize")),
        _p("megatron.training.initialize:validate_args",
           "validate the flags against Megatron-LM's arguments, refuse what the plugin "
           "cannot serve, set the replica engine's instance count; refuse a start whose "
           "dataset-helper build would fail, naming the fix", MLM),
        _p("megatron.training.initialize:_initialize_distributed",
           "join the control plane before torch.distributed starts; a restarted worker "
           "joins the rebuilt process groups of the running job instead", MLM),
        _p("megatron.training.training:load_checkpoint",
           "a restarted worker gets its state from its peers, not from --load", MLM),
        _p("megatron.training.training:build_train_valid_test_datasets",
           "keep the datasets: recovery rebuilds the data iterators at a sample count", MLM),
        _p("megatron.training.training:setup_model_and_optimizer",
           "keep the call: elastic training builds model and optimizer again in a smaller or "
           "larger world", MLM),
        _p("megatron.training.training:train",
           "run the training loop under the fault handler, re-enter it after a repair", MLM),
        _p("megatron.training.training:train_step",
           "report the step's phases (forward, backward) and its loss", MLM),
        _p("megatron.training.training:print_rank_last",
           "no second log line for an iteration recomputed after a rollback (training_log "
           "runs on: its timers are collectives): logged exactly once (SPEC 11)", MLM),
        _p("megatron.training.training:post_training_step_callbacks",
           "the 'after' phase of a step, with its iteration", MLM),
        _p("megatron.training.training:checkpoint_and_decide_exit",
           "the end of a step (after the periodic save): step reports and snapshots", MLM),
        _p("megatron.training.training:save_checkpoint",
           "the 'save' phase of a step (TFT_INJECT), after Megatron-LM's own save; the live "
           "model and optimizer (new ones after a scale change)", MLM),
        *(_p(f"{module}:pretrain", "leave the control plane when training ended", MLM)
          for module in ("megatron.training.training", "megatron.training")),
        _p("megatron.core.datasets.utils:compile_helpers", "Megatron-LM's megatron/training "
           "on the megatron-core wheel: the helpers ship built, there is no Makefile", MCORE),
    )),
    Moment("megatron-lm-cpu", "the Megatron-LM host adaptor, on CPU",
           "mindspeed_tft.megatron.cpu:install_patches", (
        _p("megatron.training.training:initialize_megatron",
           "asserts CUDA unless allow_no_cuda: on CPU it is allowed", MLM),
        _p("torch.cuda:device_count", "Megatron-LM builds megatron-core's parallel state "
           "only when device_count() > 0: one 'device', the CPU", TORCH),
        _p("torch.cuda:set_device", "there is no device to select on CPU", TORCH),
        _p("megatron.legacy.fused_kernels:load",
           "needs nvcc; CPU runs use no fused kernel (their flags are off)", MLM),
        _p("megatron.training.initialize:_warmup_jit_function",
           "warms CUDA JIT kernels; CPU runs keep megatron-core's helpers eager", MLM),
    )),
    Moment("torchrun", "scripts/patch_torchrun.sh or the guide's `import "
           "mindio_ttp.framework_ttp` in torchrun: worker reboot under plain torchrun",
           "mindspeed_tft.launcher.torchrun_hook:install_torchrun_hook", (
        _p("torch.distributed.run:get_args_parser", "torchrun's parser plus the launcher's "
           "--tft-spares-per-node", TORCH),
        _p("torch.distributed.run:run",
           "runs with high availability go through the mindspeed-tft agent", TORCH),
    )),
    Moment("scoped", "swapped for a `with` block and put back (see `swapped`)", None, (
        _p("torch:Tensor.type", "inside the functions the cpu moment wraps for it: CPU "
           "tensors answer 'torch.cuda.*Tensor' (`cpu_adaptor._cuda_type_names`, depth-counted)",
           TORCH),
        _p("torch:compile", "megatron-core's import decorates fused helpers with "
           "torch.compile (pulls in Inductor): eager on CPU (`import_megatron_core`)", MCORE),
        _p("torch.distributed.launcher.api:LocalElasticAgent",
           "tft-run: torch's launch with the mindspeed-tft agent", TORCH),
        _p("torch.distributed.elastic.agent.server.local_elastic_agent:start_processes",
           "tft-run: the agent's own process context (restart only failed workers)", TORCH),
        *(_p(f"torch.distributed:{name}", "a restarted worker's Megatron-LM start-up, between "
             "joining the rebuilt groups and its training loop: answered locally (its peers "
             "are parked; `mindspeed_tft.megatron.adaptor._LocalCollectives`)", TORCH)
          for name in ("barrier", "all_reduce", "broadcast", "all_gather",
                       "all_gather_into_tensor", "_all_gather_base", "all_gather_object",
                       "broadcast_object_list")),
        *(_p(f"{module}:dist_all_gather_func", "the same, for megatron-core's own binding of "
             "torch's all-gather", MCORE)
          for module in ("megatron.core.timers", "megatron.core.utils")),
    )),
)

_MOMENTS = {moment.name: moment for moment in TABLE}
_installed: set[str] = set()


def moment(name: str) -> Moment:
    """The table row of moment `name` (ValueError naming the known ones otherwise)."""
    try:
        return _MOMENTS[name]
    except KeyError:
        raise ValueError(
            f"unknown patch moment {name!r}; known: {', '.join(_MOMENTS)}"
        ) from None


def _load(dotted: str) -> Any:
    module_name, _, name = dotted.partition(":")
    value: Any = importlib.import_module(module_name)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def resolve(target: str) -> tuple[Any, str, Any]:
    """(owner, attribute name, current value) of a ``module:qualified.name`` target."""
    module_name, _, name = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *path, attr = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    if isinstance(owner, type) and attr in owner.__dict__:
        return owner, attr, owner.__dict__[attr]  # the class's own (a staticmethod stays one)
    return owner, attr, getattr(owner, attr)  # a module's, or one a class inherits


def applicable(name: str, megatron_core: Any) -> tuple[Patch, ...]:
    """The patches of moment `name` that apply on megatron-core `megatron_core` (a
    `packaging` Version: `mindspeed_tft.platform.megatron_version.version()` in a training
    process)."""
    return tuple(p for p in moment(name).patches if p.version.covers(megatron_core))


def install(name: str) -> bool:
    """Install the patches of moment `name` (once per process); True if this call did."""
    row = moment(name)
    if row.installer is None:
        raise ValueError(f"moment {name!r} is scoped: use `swapped`, not `install`")
    if name in _installed:
        return False
    _load(row.installer)()
    _installed.add(name)
    return True


def installed() -> list[str]:
    """The moments installed in this process, in installation order."""
    return [m.name for m in TABLE if m.name in _installed]


@contextlib.contextmanager
def swapped(target: str, value: Any) -> Iterator[None]:
    """Replace a declared scoped target by `value` for the duration of the block."""
    if target not in {p.target for p in moment("scoped").patches}:
        raise ValueError(f"{target} is not declared as a scoped patch in mindspeed_tft.patches")
    owner, attr, old = resolve(target)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        setattr(owner, attr, old)
