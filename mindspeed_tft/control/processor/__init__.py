"""The processor side, in every training process (SPEC 3, 4, 6).

What a rank answers and reports is decided by its cores, without I/O, each with one entry
point, `handle(input, now)`: `core.ProcessorCore` (with its hang `watchdog`),
`link.LinkCore` and the lane policy (`lanes`). `processor.Processor` is their shell: a
`channel` to the controller (socket, I/O thread), a `gate` for the training thread (the core
behind a lock) and the `orders` worker threads. Imports `wire/`, never `controller/`.

Modules:

- `core`: `ProcessorCore`, what a rank answers to each order and reports, without I/O
- `watchdog`: the hang watchdog's decisions, without I/O (time is passed in)
- `link`: `LinkCore`, registration, heartbeats and failover, without I/O
- `lanes`: the lane policy: which lane runs an order, and when one no longer holds it up
- `processor`: `Processor`, the cores' shell, and the hooks the trainer calls
- `channel`: the DEALER socket and the I/O thread around `link`
- `gate`: where the training thread is held, stopped and handed work
- `orders`: the two lanes of worker threads that run the orders' callbacks
- `handler`: the exception handler around the training function (SPEC 6)
- `termination`: what SIGTERM does, and how a decided exit ends the process
"""
