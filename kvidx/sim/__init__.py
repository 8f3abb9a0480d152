"""The fleet simulator (`kvidx simulate`): simulated fleets of the engines' simulated replicas
(kvidx/engines/<name>/sim.py) routed through the index, the workloads and the serving model."""
