"""Centralised baselines for the swarm: the same preset, model, data and LightningModule trained on one device, with
DistributedDataParallel, with FSDP2 parameter sharding, or with DataParallel; every run writes one run result
(hivetrain.run_result) for the logbook (python -m benchmarks.logbook build)."""
