"""The engine fleet: the one owner of the engine actors (control plane below the refit controller).

- ``health``    — engine health as a pure state machine (no Ray): serving set, epoch, replacements.
- ``placement`` — one placement group per engine (its GPUs / TP group, its node).
- ``fleet``     — the ``EngineFleet`` actor: creates, probes, replaces, publishes ``FleetView``s.
- ``client``    — ``FleetClient``: the data plane's pickle-safe view (handles + epoch + routing).
"""
