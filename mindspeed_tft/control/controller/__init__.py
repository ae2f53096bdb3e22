"""The controller side: one active controller per job, and its backups (SPEC 4, 5).

Every decision is the core's (`core.ControllerCore`: no socket, thread or clock), made by the
parts it hands each input to; `controller.Controller` is its shell. Imports `wire/`, never
`processor/`. Standalone: `python -m mindspeed_tft.control.controller`.

Modules:

- `core`: `ControllerCore`, every decision of a controller, a state machine without I/O
- `context`: what every part of the core shares: settings, table, state machine, outbox
- `inputs`: what the core takes in, one typed value per kind of input (`handle`'s)
- `outbox`: what the core decides in answer to one input: frames, events, the upstream
- `registration`: which connection speaks for which rank, and the roll call of INIT
- `liveness`: which connected ranks are gone, from their silence or their processes
- `inbox`: what the controller does with each message a processor or a backup sends
- `incidents`: the incident under way, the incident counters and the orders that carry it
- `flow`: `IncidentFlow`, one incident's handling through its stages (SPEC 5)
- `phases`: an incident's stages and their transitions as a table, and the decisions' reasons
- `dumping`: the dying-gasp checkpoint's stages of an incident: dump, then rename
- `scaling`: elastic training's phases: shrink or grow from the lock step's dump
- `strategy`: `StrategyPlanner`, the strategy (SPEC 6) and the payload of every order
- `states`: the controller's state machine (SPEC 5) as a transition table
- `ranktable`: one row per rank: connection, step, data status, health, layout
- `elasticity`: what the controller knows to grow a shrunk job back
- `nodes`: nodes whose launcher fell silent, decided without waiting for restarts
- `backup`: backups kept in sync, and a backup taking charge
- `controller`: `Controller`, the core's shell: the loop thread, the clocks, commands
- `sockets`: the ROUTER, its connection monitor, the ZeroMQ context, the wake-up pipe
- `admission`: which connections the controller keeps, so that no peer locks a rank out
- `procwatch`: the shell's watch over ranks in the controller's pid namespace
- `metrics`: the active controller's metrics endpoint (OpenMetrics over HTTP)
- `__main__`: `python -m mindspeed_tft.control.controller`, a standalone controller
"""
