"""The processor side, in every training process: the `processor.Processor` made of a
`channel` to the controller, a `gate` for the training thread, the `orders` worker threads and
a `watchdog` for hangs; `handler` wraps the training function, `termination` decides what
SIGTERM and a decided exit do. Imports `wire/`, never `controller/`."""
