"""What the controller side and the processor side share. Imports nothing from `controller/`
or `processor/`.

Modules:

- `protocol`: the frames: msgpack, a version, a typed payload and a size cap per type
- `fields`: checked reading of the maps that orders and results travel as
- `order_types`: typed orders, the payload of every order a controller sends
- `results`: typed results and reports, what a rank sends back
- `messages`: typed payloads of every other message type (register, heartbeat, sync, ...)
- `names`: the message types' names, allowed values and bounds the typed payloads use
- `callbacks`: `RecoveryCallbacks`, the typed Protocol of what a rank does for each order
- `classify`: fault kinds and the classification of a training process's errors (SPEC 6)
- `peers`: who a peer is, without I/O: addresses, the job token's check, refusals
- `config`: `ControlConfig`, the control plane's settings from the environment (SPEC 4)
- `transport`: ZeroMQ sockets: a ROUTER on controllers, a DEALER per processor, CURVE
- `keys`: CURVE key files for the control plane, one folder per role
- `priority`: the scheduling priority of the control plane's threads
- `local`: controllers hosted by this process, so that an exiting rank lets them finish
"""
