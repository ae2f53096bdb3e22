"""A deterministic simulator of the control plane: the real controller core under faults.

One seed is one schedule: a layout (DP x TP x PP, optimizer replicas, elastic or not, warm
spares), a network (per-connection FIFO links with delays, disconnects and reconnects) and
faults (kill, UCE on each target, communication errors, hangs, raised errors, the loss of a
node, a launcher's death) placed at points of a step or of a recovery, several at once. The
run feeds the real `ControllerCore` from a virtual clock: W simulated ranks run the
processor's real cores (`processor.core.ProcessorCore`: what a rank answers to each order;
`processor.link.LinkCore`: registration, heartbeats, failover) over the real wire protocol,
with a trainer model (update start and end, step reports, the fault handler, the recovery
callbacks' effects on the state they hold); launchers restart (or do not restart) their
workers. After every event the protocol's invariants (`invariants`) are checked, and at the
end the run's ending is judged against the one its schedule owes (`oracle`). Nothing here
reads a socket, a wall clock or an unseeded random source: a seed replays exactly.
It imports the control plane's core and wire only, never hosts, the plugin or torch.

Modules:

- `job`: one run: the real controller core, W simulated ranks, launchers, a network
- `schedule`: what a run does (layout, network, faults) from a seed; the generator; shrinking
- `loop`: the virtual clock and network
- `rank`: a simulated process: the processor's real cores in a shell of virtual time
- `trainer`: the trainer model of a simulated rank: its training thread and callbacks
- `launcher`: a simulated launcher per node: its workers' ends and their replacements
- `controllers`: the simulated controller processes: the active one and a backup
- `invariants`: every check, classified (correctness, liveness, crash), after every event
- `oracle`: the ending a schedule owes, a model that shares no code with the controller
- `cli`: `tft-sim`: many seeds, or one schedule replayed
- `__main__`: `python -m mindspeed_tft.control.sim`, the same as `tft-sim`
"""
