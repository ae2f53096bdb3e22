"""The processor side, in every training process (SPEC 3, 4, 6).

What a rank answers and reports is decided by its cores (`core.ProcessorCore`,
`link.LinkCore`: no socket, thread or clock); `processor.Processor` is their shell. Imports
`wire/`, never `controller/`.

Modules:

- `core`: `ProcessorCore`, what a rank answers to each order and reports, without I/O
- `link`: `LinkCore`, registration, heartbeats and failover, without I/O
- `processor`: `Processor`, the cores' shell, and the hooks the trainer calls
- `channel`: the DEALER socket and the I/O thread around `link`
- `gate`: where the training thread is held, stopped and handed work
- `orders`: the two lanes of worker threads that run the orders' callbacks
- `watchdog`: notices a training thread that stopped making progress (a hang)
- `handler`: the exception handler around the training function (SPEC 6)
- `termination`: what SIGTERM does, and how a decided exit ends the process
"""
