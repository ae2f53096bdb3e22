"""`tft-run`: a drop-in for torchrun that restarts only failed workers when worker reboot is on.

    tft-run [torchrun options] [--tft-spares-per-node K] train.py [training args]

Without high availability in the training command this is torchrun: the arguments go to
`torch.distributed.run`'s own `run`, unchanged. With it, the same torch machinery runs with
the mindspeed-tft agent (`agent.TFTElasticAgent`): the controller in node 0's launcher and,
with worker reboot, restarts of failed workers only (see `agent` and `options`).

On one node (`--nnodes 1`) with high availability and no `TTP_JOB_TOKEN`, the launcher makes
a random per-job token and puts it into its own and its workers' environment: the controller
then accepts registrations only from processes that carry it (see docs/design.md, "Security
of the control plane"). With several nodes, set `TTP_JOB_TOKEN` on every node yourself.

`--max-restarts N` keeps torchrun's meaning, the restarts of failed workers this node makes;
with worker reboot each restarts only the failed worker (`options.restart_budget`).

Exit codes: 0 when every worker succeeded; with high availability, 75 when the job ended with
a dying-gasp checkpoint (the failed workers all exited with 75); otherwise torchrun's
failure (the `ChildFailedError` summary, exit code 1); 2 for a bad launcher setting, a
training command whose first fault could only fail (no `--save`), or a controller port in
use.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.run import parse_min_max_nnodes

from mindspeed_tft import patches

from .agent import agent_factory, say
from .options import LauncherError, get_args_parser, launch_options, torch_run_functions


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """torchrun's arguments plus the launcher's (`--tft-spares-per-node`)."""
    return get_args_parser().parse_args(None if argv is None else list(argv))


MEGATRON_LM_RUNNER = "mindspeed_tft.megatron"


def megatron_lm_entry(args: argparse.Namespace) -> bool:
    """A training script that uses Megatron-LM's `megatron.training` and does not install
    the adaptor itself (`import mindspeed_tft.megatron_adaptor`) is run by the workers as
    `python -m mindspeed_tft.megatron SCRIPT ARGS` (so an unchanged script gets the plugin);
    returns whether `args` were changed so."""
    if args.module or args.no_python:
        return False
    try:
        with open(args.training_script, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return False
    if "megatron.training" not in text or "mindspeed_tft" in text:
        return False
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script = MEGATRON_LM_RUNNER
    args.module = True
    return True


#: the exit code of a worker that refused a flag, a variable or a checkpoint at start; passed
#: through when every failed worker exited with it
WORKER_USAGE_EXIT_CODE = 2


def _refused_at_start(error: ChildFailedError) -> int | None:
    """`WORKER_USAGE_EXIT_CODE` (said, with torchrun's summary) when the first worker that
    failed exited with it (it refused a flag, a variable or a checkpoint) and every other
    one either did too or was stopped by the launcher after it (SIGTERM, SIGKILL), else
    None."""
    _, first = error.get_first_failure()
    stopped = {WORKER_USAGE_EXIT_CODE, -signal.SIGTERM, -signal.SIGKILL}
    if first.exitcode != WORKER_USAGE_EXIT_CODE or not all(
            failure.exitcode in stopped for failure in error.failures.values()):
        return None
    print(error.format_msg(), file=sys.stderr, flush=True)
    say(f"ranks {sorted(error.failures)} refused their settings (exit code "
        f"{WORKER_USAGE_EXIT_CODE}; their error is above); exit code {WORKER_USAGE_EXIT_CODE}")
    return WORKER_USAGE_EXIT_CODE


def hosts_controller(args: argparse.Namespace) -> bool:
    """Whether this launcher will host the job's controller, known before the rendezvous:
    the only node, or node 0 of a static rendezvous (torchrun's default)."""
    if parse_min_max_nnodes(args.nnodes)[1] == 1:
        return True
    return args.rdzv_backend == "static" and int(args.node_rank or 0) == 0


def launch(args: argparse.Namespace) -> int:
    """Launch the workers of parsed launcher arguments; returns the launcher's exit code
    (a torchrun failure raises `ChildFailedError`, as torch's `run` does)."""
    try:
        options = launch_options(args)
    except LauncherError as e:
        say(f"error: {e}")
        return 2
    from mindspeed_tft.control.wire.transport import raise_fd_limit

    # node 0's launcher serves the rendezvous store (and the controller), whose connections
    # any local user can open: the soft open-files limit up to the hard one (workers inherit)
    raise_fd_limit()
    args.max_restarts = options.torch_max_restarts  # torch's whole-group restarts
    if megatron_lm_entry(args):
        say(f"{args.training_script_args[0]} is a Megatron-LM training script: its workers run "
            "it through `python -m mindspeed_tft.megatron` (the Megatron-LM host adaptor)")
    if not options.high_availability:
        try:
            torch_run_functions()[0](args)
        except ChildFailedError as e:
            if _refused_at_start(e) is None:
                raise
            return WORKER_USAGE_EXIT_CODE
        return 0

    from mindspeed_tft.control.wire.config import ControlConfig, ControlConfigError, check_port_free
    from mindspeed_tft.control.wire.transport import check_bind

    try:
        config = ControlConfig.from_env()
        # this launcher hosts the controller (node 0) or a backup (nodes 1, 2): refuse an
        # unauthenticated network bind now, not from inside torch's agent
        check_bind(config, config.controller_addr, "the controller")
        if hosts_controller(args):
            check_port_free(config.controller_addr, config.port)
    except ControlConfigError as e:
        say(f"error: {e}")
        return 2
    dump_exit_code = config.dump_exit_code
    if config.job_token is None and parse_min_max_nnodes(args.nnodes)[1] == 1:
        # one node: a per-job secret the controller (in this launcher) and the workers (its
        # children) share, which other users' processes cannot read; with several nodes the
        # user sets TTP_JOB_TOKEN on each (a launcher cannot pass it to other nodes unseen)
        os.environ["TTP_JOB_TOKEN"] = secrets.token_hex(32)
    say(options.describe())
    try:
        with patches.swapped("torch.distributed.launcher.api:LocalElasticAgent",
                             agent_factory(options)):
            torch_run_functions()[0](args)
    except ControlConfigError as e:  # the controller's port taken since the check above
        say(f"error: {e}")
        return 2
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        if codes == {dump_exit_code}:
            print(e.format_msg(), file=sys.stderr, flush=True)
            say(f"the job ended with a dying-gasp checkpoint (ranks {sorted(e.failures)} "
                f"exited with {dump_exit_code}); exit code {dump_exit_code}")
            return dump_exit_code
        if _refused_at_start(e) is None:
            raise
        return WORKER_USAGE_EXIT_CODE
    return 0


@record
def main(argv: Sequence[str] | None = None) -> int:
    """The `tft-run` console script."""
    return launch(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
