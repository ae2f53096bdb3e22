"""The processor side, in every training process. Its cores, without I/O (each with one entry
point, `handle(input, now)`): `core` (`ProcessorCore`: what a rank answers and reports; its
hang `watchdog`), `link` (`LinkCore`: registration, heartbeats, failover) and `lanes` (the lane
policy: which lane runs an order, and when). Their shell, `processor.Processor`, is made of a
`channel` to the controller (socket, I/O thread), a `gate` for the training thread (the
core behind a lock) and the `orders` worker threads; `handler` wraps the training function,
`termination` decides what SIGTERM and a decided exit do. Imports `wire/`, never
`controller/`."""
