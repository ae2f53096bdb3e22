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
workers. After every event the protocol's invariants are checked, and at the end the
run's ending is judged against the one its schedule owes (`oracle`). Nothing here reads a
socket, a wall clock or an unseeded random source: a seed replays exactly.

Modules: `loop` (virtual clock, network), `rank` (a simulated process: the processor's
cores in a shell of virtual time), `trainer` (its training thread and callbacks), `launcher`,
`controllers` (the active controller and a backup), `schedule` (layouts, faults, the seeded
generator, shrinking), `invariants` (every check, classified: correctness, liveness, crash),
`oracle` (the ending a schedule owes, a model apart from the controller), `job` (one run),
`cli` (`tft-sim`). It imports the control plane's core and wire only, never hosts, the
plugin or torch.
"""
