"""The Megatron-LM host: mindspeed-tft inside Megatron-LM's own `megatron.training` loop.

Nothing of Megatron-LM is copied or edited; the functions below wrap Megatron-LM's own
(core_v0.12.1) where its `pretrain()` calls them, and are installed together as the
``megatron-lm`` moment of `mindspeed_tft.patches`:

- `parse_args` / `validate_args`: the end of the start-up imports (`mindspeed_tft.startup`,
  for a loop that does not enter `pretrain()`); the mindspeed-tft flags join Megatron-LM's
  parser (unless a framework built on it, MindSpeed-LLM, already has them); after its own
  validation, `validate_tft_args` and the combinations this host cannot serve
  (`HOST_REFUSALS`: each refused with the flag and the fix). With high availability the
  checkpoint format is Megatron-LM's ``torch`` (the dump is written in it), chosen for the
  user when `--ckpt-format` is not given. Then, on rank 0, whether Megatron-LM can build its
  dataset helpers (`helpers.build_problem`): if not, one line naming the fix, exit 2.
- `_initialize_distributed`: the control plane is joined before torch.distributed starts;
  a restarted worker (worker reboot) joins the rebuilt process groups of the running job
  instead, then rebuilds model, optimizer and data exactly as at start-up while its
  collectives are answered locally (`_LocalCollectives`: its peers are mid-training) and
  `--load` is skipped (its state comes from its peers).
- `build_train_valid_test_datasets`: the datasets are kept, to rebuild the data iterators
  at a sample count (model, optimizer and scheduler arrive with `train`).
- `setup_model_and_optimizer`: the call is kept, so that elastic training can build model,
  optimizer and scheduler again in a smaller or larger world (Megatron-LM's own setup,
  without `--load`), then load the dump into them (`_rebuild_model_and_optimizer`).
- `train`: runs under the fault handler (`TFTPlugin.run`) with the host's `TrainingState`;
  after a repair it is entered again with the state's model, optimizer and scheduler (new
  ones after a scale change), the rebuilt data iterators and the training config as it was
  at its first entry.
- `train_step` / `post_training_step_callbacks` / `checkpoint_and_decide_exit`: the step's
  phases, its loss (`events.iteration_log`: the ``iteration`` event), its end;
  `print_rank_last`: no second log line for an iteration recomputed after a rollback
  (`training_log` itself runs as ever on every rank: it holds collectives);
  `save_checkpoint`: the ``save`` phase, once Megatron-LM's own save returned (it
  publishes inside, so a fault injected there hits a published checkpoint, unlike the
  reference trainer's); it saves the state's model, optimizer and scheduler (`pretrain`'s
  own, after `train`, are stale after a scale change). A write of it that fails (a full
  file system: `layout.in_place_save_writes`) removes the rank's partial folder, keeps the
  tracker on the last checkpoint, prints one line naming the save folder and its free space
  and raises (with high availability a fault: the dump is tried).
- `pretrain`: a warm spare of `tft-run` waits for its rank first; the control plane is left
  when training ended.
- `compile_helpers`: Megatron-LM's `megatron/training` on the megatron-core wheel, which
  ships the dataset helpers built but no Makefile to build them: nothing to make.

The dying-gasp checkpoint is written with Megatron-LM's `generate_state_dict` (its torch
format), so Megatron-LM's `--load` resumes from it; a repair without replicas reloads the
periodic checkpoint in place with Megatron-LM's `load_checkpoint`.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_tft.arguments import TFTArgumentError, add_tft_args, validate_tft_args
from mindspeed_tft.control.processor.termination import exit_without_teardown
from mindspeed_tft.events import iteration_log
from mindspeed_tft.megatron.helpers import build_problem
from mindspeed_tft.plugin import SETUP_IMPORTS, TFTPlugin
from mindspeed_tft.plugin.hooks import (
    TrainerHooks,
    phase_reporting_forward_step,
    set_update_listener,
)
from mindspeed_tft.plugin.state import TrainingState
from mindspeed_tft.process_exit import print_error

log = logging.getLogger("mindspeed_tft.megatron")

def _set(name: str) -> Callable[[argparse.Namespace], bool]:
    """Whether Megatron-LM's switch `name` is on (False where this version has no such
    switch: core_v0.12.1 has --use-custom-fsdp, core_v0.16.1 --use-megatron-fsdp and
    --inprocess-restart)."""
    return lambda args: bool(getattr(args, name, False))


#: flag -> (is it set on these args?, why the plugin cannot serve it, the fix); Megatron's
#: own fault-tolerance switches are decided in docs/design.md ("Megatron-LM core_v0.16.1")
HOST_REFUSALS: tuple[tuple[str, Callable[[argparse.Namespace], bool], str], ...] = (
    ("--exit-signal-handler", _set("exit_signal_handler"),
     "the plugin handles SIGTERM itself (a launcher's SIGTERM must not end a rank that is "
     "writing the dump); remove --exit-signal-handler"),
    ("--use-dist-ckpt", _set("use_dist_ckpt_deprecated"),
     "the dump is written in Megatron-LM's torch format; remove --use-dist-ckpt"),
    ("--async-save", _set("async_save"),
     "the torch checkpoint format saves synchronously; remove --async-save"),
    ("--use-torch-fsdp2", _set("use_torch_fsdp2"),
     "replicas shard the distributed optimizer's state, not FSDP's; remove --use-torch-fsdp2"),
    ("--use-custom-fsdp", _set("use_custom_fsdp"),
     "replicas shard the distributed optimizer's state, not FSDP's; remove --use-custom-fsdp"),
    ("--use-megatron-fsdp", _set("use_megatron_fsdp"),
     "replicas shard the distributed optimizer's state, not FSDP's; remove "
     "--use-megatron-fsdp"),
    ("--virtual-pipeline-model-parallel-size",
     lambda a: a.virtual_pipeline_model_parallel_size is not None,
     "interleaved pipelines are not supported by this host yet; remove it"),
    ("--rerun-mode report_stats", lambda a: a.rerun_mode == "report_stats",
     "Megatron-LM's rerun state machine would run every step twice and compare, and a fault "
     "in the second run is not one the plugin can roll back to; use --rerun-mode "
     "validate_results or disabled"),
    ("--enable-ft-package", _set("enable_ft_package"),
     "nvidia-resiliency-ext's fault tolerance would act on the same faults (its launcher "
     "restarts the whole job); remove it"),
    ("--inprocess-restart", _set("inprocess_restart"),
     "nvidia-resiliency-ext's in-process restart would act on the same faults (it restarts "
     "the training function on every rank); remove it"),
    ("--log-straggler", _set("log_straggler"),
     "Megatron's straggler detector is configured once for the world size at start (an "
     "elastic shrink or grow changes it) and listens on 0.0.0.0 without authentication on "
     "rank 0; remove --log-straggler"),
    ("--non-persistent-save-interval", lambda a: a.non_persistent_save_interval is not None,
     "repairs and dumps use the persistent checkpoints under --save; remove it"),
)


def _flag_given(flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in sys.argv[1:])


def check_host_args(args: argparse.Namespace, optimizer_instances: int) -> None:
    """With high availability: refuse what this host cannot serve, and use Megatron-LM's
    torch checkpoint format unless the user chose another one (then refuse it).
    `optimizer_instances` is the user's --num-distributed-optimizer-instances."""
    if not args.enable_high_availability:
        return
    if optimizer_instances != 1:
        raise TFTArgumentError(
            f"--num-distributed-optimizer-instances {optimizer_instances} cannot be combined "
            "with --enable-high-availability: the plugin sets it from --optimizer-replica-num; "
            "remove it"
        )
    for flag, given, fix in HOST_REFUSALS:
        if given(args):
            raise TFTArgumentError(
                f"{flag} cannot be combined with --enable-high-availability: {fix}"
            )
    if args.ckpt_format != "torch":
        if _flag_given("--ckpt-format"):
            raise TFTArgumentError(
                f"--ckpt-format {args.ckpt_format} cannot be combined with "
                "--enable-high-availability: the dying-gasp checkpoint is written in "
                "Megatron-LM's torch format; allowed: --ckpt-format torch (the default "
                "under --enable-high-availability)"
            )
        args.ckpt_format = "torch"
        args.use_dist_ckpt = False
        if args.rank == 0:
            print("[mindspeed-tft] --enable-high-availability: checkpoints in Megatron-LM's "
                  "torch format (--ckpt-format torch)", flush=True)


class _LocalCollectives:
    """A restarted worker's start-up: Megatron-LM's collectives answered locally.

    Between joining the rebuilt process groups and entering the training loop, a restarted
    worker runs Megatron-LM's start-up again (seeds, model, optimizer, datasets, loaders),
    while its peers are parked waiting for it. The start-up's collectives (barriers around
    timers and dataset caches, the start-time all-reduce, the loader-flag broadcast) would
    wait for peers that never call them; each is answered with what this rank computed for
    itself, which on these paths is what every rank computes. Real communication resumes
    when the training loop is entered (the repair's shard copy and rollback)."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None

    @staticmethod
    def _done(async_op: bool = False) -> Any:
        class _Done:
            def wait(self, *args: Any, **kwargs: Any) -> bool:
                return True

            def is_completed(self) -> bool:
                return True

        return _Done() if async_op else None

    def _stand_ins(self) -> dict[str, Callable[..., Any]]:
        def barrier(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            return self._done(async_op)

        def unchanged(tensor: Any, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            return self._done(async_op)

        def all_gather(outputs: list[Any], tensor: torch.Tensor, *args: Any,
                       async_op: bool = False, **kwargs: Any) -> Any:
            for out in outputs:
                out.copy_(tensor)
            return self._done(async_op)

        def gather_into(output: torch.Tensor, tensor: torch.Tensor, *args: Any,
                        async_op: bool = False, **kwargs: Any) -> Any:
            output.view(-1, tensor.numel()).copy_(tensor.reshape(1, -1).clone())
            return self._done(async_op)

        def gather_object(outputs: list[Any], obj: Any, *args: Any, **kwargs: Any) -> None:
            outputs[:] = [obj] * len(outputs)

        stand_ins: dict[str, Callable[..., Any]] = {
                     "barrier": barrier, "all_reduce": unchanged, "broadcast": unchanged,
                     "all_gather": all_gather, "all_gather_into_tensor": gather_into,
                     "_all_gather_base": gather_into, "all_gather_object": gather_object,
                     "broadcast_object_list": unchanged}
        targets = {f"torch.distributed:{name}": fn for name, fn in stand_ins.items()}
        # megatron-core modules that bound torch's all-gather to a name of their own
        for module in ("megatron.core.timers", "megatron.core.utils"):
            targets[f"{module}:dist_all_gather_func"] = gather_into
        return targets

    def start(self) -> None:
        from mindspeed_tft import patches

        stack = contextlib.ExitStack()
        for target, stand_in in self._stand_ins().items():
            stack.enter_context(patches.swapped(target, stand_in))
        self._stack = stack

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None


class MegatronHost:
    """What the Megatron-LM adaptor keeps for one training process."""

    def __init__(self) -> None:
        self.plugin: TFTPlugin | None = None
        self.state: TrainingState | None = None
        self.hooks: TrainerHooks = TrainerHooks()
        self.datasets: tuple[Any, Any, Any] | None = None
        self.datasets_provider: Any = None
        self.local = _LocalCollectives()
        self.training_config: dict[str, Any] | None = None
        #: the iteration of the last step when it was a recomputed one (logged before the
        #: fault: its line is not printed again)
        self.recomputed: int | None = None
        #: Megatron-LM's `setup_model_and_optimizer` and the arguments `pretrain` called it
        #: with (elastic training builds them again)
        self.setup_call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None = None

    @property
    def rejoining(self) -> bool:
        return self.plugin is not None and self.plugin.rejoining


_host = MegatronHost()


def _args() -> argparse.Namespace:
    from megatron.training import get_args

    return get_args()


# --- arguments ---------------------------------------------------------------------------


def _with_tft_args(extra_args_provider: Any) -> Callable[[argparse.ArgumentParser], Any]:
    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        if "--enable-high-availability" not in parser._option_string_actions:
            parser = add_tft_args(parser)
        return parser

    return provider


def wrap_parse_args(original: Callable[..., Any]) -> Callable[..., Any]:
    def parse_args(extra_args_provider: Any = None, ignore_unknown_args: bool = False) -> Any:
        from mindspeed_tft import startup

        # a loop that does not enter Megatron-LM's pretrain() (see wrap_pretrain) still
        # parses its arguments before it builds anything
        startup.imports_done()
        args = original(_with_tft_args(extra_args_provider), ignore_unknown_args)
        refuse_inprocess_restart(args)
        return args

    return parse_args


def refuse_inprocess_restart(args: argparse.Namespace) -> None:
    """core_v0.16.1's `pretrain_gpt.py` wraps `pretrain` for in-process restart at import,
    right after parsing the arguments (`maybe_wrap_for_inprocess_restart`), before
    `validate_args`: with high availability, --inprocess-restart is refused here (the rest of
    `HOST_REFUSALS` after Megatron-LM's validation). Every rank prints the line, as every
    refusal at start: the first to exit makes the launcher stop the others."""
    if getattr(args, "inprocess_restart", False) and getattr(
            args, "enable_high_availability", False):
        flag, _, fix = next(r for r in HOST_REFUSALS if r[0] == "--inprocess-restart")
        print_error(f"{flag} cannot be combined with --enable-high-availability: {fix}")
        raise SystemExit(2)


def wrap_validate_args(original: Callable[..., Any]) -> Callable[..., Any]:
    def validate_args(args: argparse.Namespace, defaults: dict | None = None) -> Any:
        from mindspeed_tft.platform import distributed_backend

        result = original(args, defaults or {})
        args.distributed_backend = distributed_backend(args.distributed_backend)
        optimizer_instances = args.num_distributed_optimizer_instances
        try:
            validate_tft_args(args)
            check_host_args(args, optimizer_instances)
        except TFTArgumentError as error:
            print_error(str(error))  # every rank: the launcher may stop rank 0 before it
            raise SystemExit(2) from None
        if args.rank == 0:
            # rank 0 builds Megatron-LM's dataset helpers: what it lacks, before it tries
            problem = build_problem()
            if problem is not None:
                print_error(problem)
                raise SystemExit(2)
            print(f"[mindspeed-tft] {args.tft_features.describe()}", flush=True)
        return result

    return validate_args


# --- start-up ----------------------------------------------------------------------------


def wrap_initialize_distributed(original: Callable[..., Any]) -> Callable[..., Any]:
    def initialize_distributed(get_embedding_ranks: Any = None,
                               get_position_embedding_ranks: Any = None, *rest: Any) -> None:
        # rest: core_v0.16.1's `store` (for torch.distributed's init, which the plugin's
        # registration precedes and a rebuild skips)
        def initialize_model_parallel(args: argparse.Namespace) -> None:
            # Megatron-LM's own start-up call: the default group exists, so it only builds
            # megatron-core's parallel state, with Megatron-LM's own arguments
            original(get_embedding_ranks, get_position_embedding_ranks, *rest)

        plugin = TFTPlugin(_args(), initialize_model_parallel)
        _host.plugin = plugin
        plugin.register()
        if plugin.rejoining:
            plugin.join_job()
            _host.local.start()
            # its state comes from its peers: random init would be overwritten (Megatron-LM's
            # own --no-initialization; the rollback restores the RNG states the init used)
            _args().perform_initialization = False
        else:
            original(get_embedding_ranks, get_position_embedding_ranks, *rest)
            plugin.setup()

    return initialize_distributed


def wrap_load_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        if _host.rejoining:
            print(f"[mindspeed-tft] rank {_args().rank}: restarted worker: its state comes from "
                  "its peers, not from --load", flush=True)
            return 0, 0
        load_arg = kwargs.get("load_arg", "load")
        root = getattr(_args(), load_arg, None)
        _repair_interrupted_publish(root)
        from mindspeed_tft.recovery import manifest  # checked before any tensor is read

        manifest.before_load(root, startup=load_arg == "load")
        return original(*args, **kwargs)

    return load_checkpoint


def _repair_interrupted_publish(root: str | None) -> None:
    """Before Megatron-LM's loader reads `root`: put back an `iter_X` that a publish of this
    project's (a dump) left as `iter_X_old` when it was killed between its two renames
    (only where the file system cannot exchange names; `layout.resolve_checkpoint`)."""
    from mindspeed_tft.recovery.layout import CheckpointError, resolve_checkpoint

    if root:
        try:
            resolve_checkpoint(root)
        except (ValueError, CheckpointError):  # "release" is Megatron-LM's to read; a bad
            pass  # tracker is refused next, in one line (`manifest.before_load`)


def wrap_build_datasets(original: Callable[..., Any]) -> Callable[..., Any]:
    def build_train_valid_test_datasets(provider: Any, *rest: Any) -> Any:
        result = original(provider, *rest)
        _host.datasets = result
        _host.datasets_provider = provider
        return result

    return build_train_valid_test_datasets


# --- the training loop -------------------------------------------------------------------


class _CachedDatasets:
    """A datasets provider answering with the datasets built at start-up; Megatron-LM reads
    its `is_distributed` as it reads the user's provider's."""

    def __init__(self, datasets: Any, is_distributed: bool) -> None:
        self.datasets = datasets
        self.is_distributed = is_distributed

    def __call__(self, num_samples: Any) -> Any:
        return self.datasets


def _rebuild_iterators(consumed_samples: int) -> Iterator | None:
    """The data iterators again at `consumed_samples`, from the datasets built at start-up
    (Megatron-LM's own loaders and iterators; collective: the loader-flag broadcast)."""
    from megatron.training import training

    args = _args()
    args.consumed_train_samples = consumed_samples
    datasets = _host.datasets

    cached = _CachedDatasets(datasets, getattr(_host.datasets_provider, "is_distributed", False))
    train_it, valid_it, _test_it = training.build_train_valid_test_data_iterators(cached)
    if _host.state is not None:
        _host.state.valid_data_iterator = valid_it
    return train_it


def _plugin_objects(args: argparse.Namespace) -> dict[str, Any]:
    """The attributes of `args` that hold objects of this package (``tft_features``): a
    checkpoint carries Megatron-LM's args, and Megatron-LM core_v0.16.1 loads with torch's
    ``weights_only`` unpickler, which refuses any class it was not told of (plain Megatron-LM
    could not read the checkpoint)."""
    return {name: value for name, value in vars(args).items()
            if type(value).__module__.split(".")[0] == "mindspeed_tft"}


@contextlib.contextmanager
def _args_for_a_checkpoint(args: argparse.Namespace) -> Iterator[None]:
    """Megatron-LM's own save (it reads the global args) without `_plugin_objects`."""
    held = _plugin_objects(args)
    for name in held:
        delattr(args, name)
    try:
        yield
    finally:
        for name, value in held.items():
            setattr(args, name, value)


def _checkpoint_state_dict(rng_state: dict[str, Any]) -> dict[str, Any]:
    """`model_optim_rng.pt` of the state's iteration, by Megatron-LM's `generate_state_dict`."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training.checkpointing import generate_state_dict

    args = _args()
    state = _host.state
    assert state is not None, "mindspeed-tft: no training state yet"
    model, optimizer, scheduler = state.model, state.optimizer, state.opt_param_scheduler
    rng = dict(rng_state)
    rng.setdefault("cuda_rng_state", rng["torch_rng_state"])
    state_dict = generate_state_dict(
        args, model, optimizer, scheduler, [rng], iteration=args.iteration,
        optim_sd_kwargs={},
        rerun_state=get_rerun_state_machine().state_dict(data_iterator=None,
                                                         ckpt_format=args.ckpt_format),
    )
    state_dict["num_floating_point_operations_so_far"] = args.num_floating_point_operations_so_far
    held = _plugin_objects(args)
    state_dict["args"] = argparse.Namespace(**{k: v for k, v in vars(args).items()
                                               if k not in held})
    return state_dict


def _load_in_place(root: str) -> int:
    """Megatron-LM's `load_checkpoint` of the latest checkpoint under `root` into the live
    model, optimizer and scheduler, with optimizer and RNG whatever the load flags say (a
    repair restores the whole state)."""
    from megatron.training import checkpointing

    args = _args()
    state = _host.state
    assert state is not None, "mindspeed-tft: no training state yet"
    model, optimizer, scheduler = state.model, state.optimizer, state.opt_param_scheduler
    saved = {name: getattr(args, name) for name in ("no_load_optim", "no_load_rng", "finetune")}
    args.no_load_optim = args.no_load_rng = args.finetune = False
    # Megatron-LM's load expects a fresh start (it asserts these are 0) and sets them
    args.consumed_train_samples = args.skipped_train_samples = args.consumed_valid_samples = 0
    args._tft_repair_root = root
    _repair_interrupted_publish(root)
    try:
        scheduler.num_steps = 0  # megatron-core's scheduler advances by the loaded count
        iteration, flops = checkpointing.load_checkpoint(model, optimizer, scheduler,
                                                         load_arg="_tft_repair_root")
    finally:
        for name, value in saved.items():
            setattr(args, name, value)
    args.num_floating_point_operations_so_far = flops
    args.iteration = iteration
    return iteration


def _rebuild_model_and_optimizer(root: str) -> int:
    """Elastic training: model, optimizer and scheduler built again for the current parallel
    state by Megatron-LM's own `setup_model_and_optimizer` (without `--load`: random init
    skipped, the dump overwrites it), the dump under `root` loaded into them, the data
    iterators rebuilt at its sample count. Returns the iteration loaded."""
    args = _args()
    state = _host.state
    assert state is not None and _host.setup_call is not None, "mindspeed-tft: no state yet"
    setup, call_args, call_kwargs = _host.setup_call
    saved = {name: getattr(args, name) for name in ("load", "pretrained_checkpoint")}
    args.load = args.pretrained_checkpoint = None
    args.perform_initialization = False
    try:
        state.model, state.optimizer, state.opt_param_scheduler = setup(*call_args,
                                                                        **call_kwargs)
    finally:
        for name, value in saved.items():
            setattr(args, name, value)
    iteration = _load_in_place(root)
    state.reset_train_data_iterator()
    _after_rollback()
    return iteration


def _after_rollback() -> None:
    """Megatron-LM state a rollback leaves behind: its timers (a timer left running by the
    interrupted step cannot be started again) and the rerun state machine's step state."""
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine
    from megatron.training import global_vars

    global_vars._GLOBAL_TIMERS = None
    global_vars._set_timers(_args())
    get_rerun_state_machine().state = RerunState.NOT_RUNNING_YET


_CONFIG_FIELDS = ("no_sync_func", "grad_sync_func", "param_sync_func")


def wrap_train(original: Callable[..., Any]) -> Callable[..., Any]:
    def train(forward_step_func: Any, model: Any, optimizer: Any, opt_param_scheduler: Any,
              train_data_iterator: Any, valid_data_iterator: Any, *rest: Any) -> Any:
        _host.local.stop()
        plugin = _host.plugin
        assert plugin is not None, "mindspeed-tft: Megatron-LM was initialized without it"
        args = _args()
        state = TrainingState(
            args=args, model=model, optimizer=optimizer, opt_param_scheduler=opt_param_scheduler,
            build_train_data_iterator=_rebuild_iterators,
            checkpoint_state_dict=_checkpoint_state_dict, load_checkpoint=_load_in_place,
            train_data_iterator=train_data_iterator, valid_data_iterator=valid_data_iterator,
            after_rollback=_after_rollback, rebuild_model_and_optimizer=_rebuild_model_and_optimizer,
        )
        _host.state = state
        plugin.attach(state)
        hooks = plugin.hooks()
        _host.hooks = hooks
        def run_once() -> Any:
            from megatron.core.utils import get_model_config

            tail = list(rest)
            if len(tail) > 1 and tail[1] is not None:  # the model's config (new ones after a
                config = tail[1] = get_model_config(state.model[0])  # scale change)
                # train() sets these and asserts they are unset
                if _host.training_config is None:
                    _host.training_config = {f: getattr(config, f) for f in _CONFIG_FIELDS}
                for name, value in _host.training_config.items():
                    setattr(config, name, value)
            set_update_listener(hooks, state)
            hooks.on_train_start(state)
            result = original(forward_step_func, state.model, state.optimizer,
                              state.opt_param_scheduler, state.train_data_iterator,
                              state.valid_data_iterator, *tail)
            hooks.on_train_end(state)
            return result

        try:
            return plugin.run(run_once)
        finally:
            set_update_listener(None, None)

    return train


def wrap_train_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def train_step(forward_step_func: Any, data_iterator: Any, model: Any, optimizer: Any,
                   opt_param_scheduler: Any, config: Any, *rest: Any, **kwargs: Any) -> Any:
        # rest, kwargs: core_v0.16.1's forward_backward_func and iteration
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        args = _args()
        state = _host.state
        assert state is not None
        args.iteration = args.curr_iteration  # completed updates before this step
        result = original(phase_reporting_forward_step(forward_step_func, state, _host.hooks),
                          data_iterator, model, optimizer, opt_param_scheduler, config, *rest,
                          **kwargs)
        loss_dict, grad_norm = result[0], result[5]
        if loss_dict:
            batch = ps.get_data_parallel_world_size() * args.micro_batch_size * \
                get_num_microbatches()
            logged = iteration_log.record(
                args.curr_iteration + 1, logger=dist.get_rank() == dist.get_world_size() - 1,
                loss=float(loss_dict["lm loss"]),
                grad_norm=None if grad_norm is None else float(grad_norm),
                lr=optimizer.param_groups[0]["lr"],
                consumed_samples=args.consumed_train_samples + batch)
            _host.recomputed = None if logged else args.curr_iteration + 1
        return result

    return train_step


def wrap_print_rank_last(original: Callable[..., Any]) -> Callable[..., Any]:
    def print_rank_last(message: Any) -> None:
        # Megatron-LM's line of a recomputed iteration (" [date] iteration <8 wide>/..."):
        # logged once before the fault, not again
        recomputed = _host.recomputed
        if recomputed is not None and f" iteration {recomputed:8d}/" in str(message):
            return
        original(message)

    return print_rank_last


def wrap_post_training_step_callbacks(original: Callable[..., Any]) -> Callable[..., Any]:
    def post_training_step_callbacks(model: Any, optimizer: Any, opt_param_scheduler: Any,
                                     iteration: int, *rest: Any) -> Any:
        args = _args()
        args.iteration = iteration
        if _host.state is not None:
            _host.hooks.on_phase(_host.state, "after", iteration - 1)
        return original(model, optimizer, opt_param_scheduler, iteration, *rest)

    return post_training_step_callbacks


def wrap_checkpoint_and_decide_exit(original: Callable[..., Any]) -> Callable[..., Any]:
    def checkpoint_and_decide_exit(model: Any, optimizer: Any, opt_param_scheduler: Any,
                                   iteration: int, *rest: Any) -> Any:
        should_exit = original(model, optimizer, opt_param_scheduler, iteration, *rest)
        if _host.state is not None:
            _host.hooks.on_step_end(_host.state)
        return should_exit

    return checkpoint_and_decide_exit


def wrap_setup_model_and_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        _host.setup_call = (original, args, kwargs)
        return original(*args, **kwargs)

    return setup_model_and_optimizer


def wrap_save_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def save_checkpoint(iteration: int, *args: Any, **kwargs: Any) -> Any:
        state = _host.state
        if state is not None and len(args) >= 3:  # the live ones, new after a scale change
            args = (state.model, state.optimizer, state.opt_param_scheduler, *args[3:])
        from mindspeed_tft.recovery import manifest
        from mindspeed_tft.recovery.layout import (
            CheckpointWriteError,
            in_place_save_writes,
            this_rank_dir_name,
        )

        root = _args().save
        manifest.before_save(root, iteration)
        try:  # a failed write (a full file system): one line, the last checkpoint kept
            with _args_for_a_checkpoint(_args()), in_place_save_writes(
                    root, iteration, this_rank_dir_name()):
                result = original(iteration, *args, **kwargs)
        except CheckpointWriteError as error:
            error.report(dist.get_rank() if dist.is_initialized() else 0)
            raise
        manifest.after_save(root, iteration)  # every rank's files are in place
        if _host.state is not None:  # Megatron-LM publishes inside its save: after it
            _host.hooks.on_phase(_host.state, "save", iteration - 1)
        return result

    return save_checkpoint


def wrap_compile_helpers(original: Callable[..., Any]) -> Callable[..., Any]:
    def compile_helpers() -> None:
        import importlib.util
        import os

        import megatron.core.datasets as datasets

        folder = os.path.dirname(os.path.abspath(datasets.__file__))
        built = importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None
        if built and not os.path.isfile(os.path.join(folder, "Makefile")):
            return  # the megatron-core wheel: helpers shipped built, nothing to make
        original()

    return compile_helpers


#: what Megatron-LM's start-up imports late (inside functions), where this version has it:
#: core_v0.16.1 builds its tokenizer (`megatron.core.tokenizers`) and einops binds its torch
#: backend on first use; a warm spare imports them before it takes a rank
LATE_START_UP_IMPORTS = ("megatron.core.tokenizers.text.models", "einops._torch_specific")


def _warm_imports() -> tuple[str, ...]:
    import importlib.util

    def present(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ImportError:  # a package on the way does not exist in this version
            return False

    return (*SETUP_IMPORTS, *(name for name in LATE_START_UP_IMPORTS if present(name)))


def wrap_pretrain(original: Callable[..., Any]) -> Callable[..., Any]:
    def pretrain(*args: Any, **kwargs: Any) -> Any:
        from mindspeed_tft import startup
        from mindspeed_tft.launcher.spare import wait_for_assignment

        # a warm spare of tft-run: imports done, waits for its rank
        wait_for_assignment(warm_imports=_warm_imports())
        startup.imports_done()
        result = original(*args, **kwargs)
        plugin = _host.plugin
        if plugin is not None:
            plugin.finish()
            if plugin.high_availability:
                # the job's end was reported: end the process without interpreter teardown
                # (process groups freed in arbitrary order were seen to abort it)
                atexit.register(_exit_finished)
        return result

    return pretrain


def _exit_finished() -> None:
    exit_without_teardown(1 if getattr(sys, "last_value", None) is not None else 0)


def install_patches() -> None:
    """The ``megatron-lm`` moment of `mindspeed_tft.patches` (once per process)."""
    import megatron.core.datasets.utils as dataset_utils
    import megatron.training
    from megatron.training import arguments, initialize, training

    arguments.parse_args = wrap_parse_args(arguments.parse_args)
    initialize.parse_args = wrap_parse_args(initialize.parse_args)
    initialize.validate_args = wrap_validate_args(initialize.validate_args)
    initialize._initialize_distributed = wrap_initialize_distributed(
        initialize._initialize_distributed)
    for name, wrap in (
        ("load_checkpoint", wrap_load_checkpoint),
        ("build_train_valid_test_datasets", wrap_build_datasets),
        ("setup_model_and_optimizer", wrap_setup_model_and_optimizer),
        ("train", wrap_train),
        ("train_step", wrap_train_step),
        ("print_rank_last", wrap_print_rank_last),
        ("post_training_step_callbacks", wrap_post_training_step_callbacks),
        ("checkpoint_and_decide_exit", wrap_checkpoint_and_decide_exit),
        ("save_checkpoint", wrap_save_checkpoint),
    ):
        setattr(training, name, wrap(getattr(training, name)))
    training.pretrain = wrap_pretrain(training.pretrain)
    megatron.training.pretrain = training.pretrain
    dataset_utils.compile_helpers = wrap_compile_helpers(dataset_utils.compile_helpers)
