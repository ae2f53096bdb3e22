"""Compute stop points (`collectives.install_stop_points`): once the control plane stopped a
rank, its training thread leaves a forward or backward pass at the next layer boundary, not
at its next collective.

Run in a fresh interpreter: `abandon()` sets process-wide state (it is what the controller's
stop does in a training process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROGRAM = textwrap.dedent("""
    import torch
    from mindspeed_tft.recovery import collectives

    class Net(torch.nn.Module):  # a transformer's shape: layers in a module list
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(8, 8)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
            self.head = torch.nn.Linear(8, 8)

        def forward(self, x):
            x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    collectives.install_connection_tracking()  # abandon() then shuts group connections only
    model = Net()
    layers = model.layers
    assert collectives.install_stop_points([model]) == 4
    assert collectives.install_stop_points([model]) == 0      # idempotent
    ran = []
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
    x = torch.randn(2, 8)
    model(x).sum().backward()                                  # not stopped: a normal step
    assert ran == [0, 1, 2, 3], ran

    def stopped(run, what):  # run() must end in the stop: its error
        try:
            run()
        except collectives.CollectivesAbandoned as error:
            return error
        raise SystemExit(f"{what} went on after the stop")

    # the stop arrives while layer 1 computes: layers 2 and 3 never run
    ran.clear()
    handle = layers[1].register_forward_hook(lambda m, a, o: collectives.abandon("test", []))
    error = stopped(lambda: model(x), "forward")
    assert "compute abandoned (test)" in str(error), error
    assert ran == [0, 1], ran
    handle.remove()

    # in backward: the stop arrives with layer 3's weight gradient; the backward pass of
    # layers 0 to 2 never runs
    collectives.reset()
    model.zero_grad(set_to_none=True)

    def stop_now(grad):
        collectives.abandon("test", [])

    layers[3].weight.register_hook(stop_now)
    loss = model(x).sum()
    stopped(loss.backward, "backward")
    assert all(layer.weight.grad is None for layer in layers[:3])
    assert model.embed.weight.grad is None

    # big modules get stop points too, small ones not: in a layer (attention, MLP) and
    # outside the layers (the output layer, whose backward a backward pass begins with)
    collectives.reset()
    width = 1448  # 1448 * 1448 + 1448 params: just over SUBLAYER_STOP_POINT_PARAMS
    assert width * width + width >= collectives.SUBLAYER_STOP_POINT_PARAMS

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.attention = torch.nn.Linear(width, width)
            self.mlp = torch.nn.Linear(width, width)

        def forward(self, x):
            return self.mlp(self.attention(self.norm(x)))

    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(2))
            self.head = torch.nn.Linear(width, width)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    big = Big()
    # each layer, its attention and mlp; the head; the model itself (not its module list)
    assert collectives.install_stop_points([big]) == 2 * 3 + 2
    assert collectives.install_stop_points([big]) == 0
    first = big.layers[0]
    ran.clear()
    first.attention.register_forward_hook(lambda m, a, o: ran.append("attention"))
    first.mlp.register_forward_hook(lambda m, a, o: ran.append("mlp"))
    x = torch.randn(2, width)
    big(x).sum().backward()
    assert ran == ["attention", "mlp"], ran
    # the stop arrives while the attention computes: the mlp of the same layer never runs
    ran.clear()
    handle = first.attention.register_forward_hook(
        lambda m, a, o: collectives.abandon("test", []))
    stopped(lambda: big(x), "forward")
    assert ran == ["attention"], ran
    handle.remove()

    # in backward: stopped with the mlp's weight gradient, the attention's backward never runs
    collectives.reset()
    big.zero_grad(set_to_none=True)
    first.mlp.weight.register_hook(stop_now)
    loss = big(x).sum()
    stopped(loss.backward, "backward")
    assert first.attention.weight.grad is None

    # stopped with the head's weight gradient: no layer's backward runs
    collectives.reset()
    big.zero_grad(set_to_none=True)
    big.head.weight.register_hook(stop_now)
    loss = big(x).sum()
    stopped(loss.backward, "backward")
    assert all(layer.mlp.weight.grad is None for layer in big.layers)
    print("ok", flush=True)
""")


def test_a_stopped_rank_leaves_forward_and_backward_at_the_next_layer(tmp_path):
    """And, where modules are big, at the next big module (attention, MLP, output layer)."""
    result = subprocess.run([sys.executable, "-c", PROGRAM], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")
