"""What the controller side and the processor side share: the frames (`protocol`), their
typed payloads (`messages`; the orders `order_types`, the results and reports `results`, all
read by `fields`; the names and bounds they use: `names`), the recovery callbacks
(`callbacks`), the sockets
(`transport`) and their keys (`keys`), the configuration read from the environment (`config`),
fault kinds and error classification (`classify`), thread priorities (`priority`) and the
registry of controllers hosted by this process (`local`). Imports nothing from `controller/`
or `processor/`."""
