"""HiveTrain: decentralized volunteer training on hivemind and PyTorch Lightning."""
