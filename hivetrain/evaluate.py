"""Validation metrics of a model on the run's validation split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device: str | torch.device = "cpu") -> dict[str, float]:
    """Mean cross-entropy, top-1 and top-5 accuracy over the whole loader."""
    was_training = model.training
    model.eval().to(device)
    total = loss = top1 = top5 = 0.0
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        batch_loss, batch_top1, batch_top5 = score(model(images), labels)
        loss, top1, top5, total = loss + batch_loss, top1 + batch_top1, top5 + batch_top5, total + len(labels)
    model.train(was_training)
    return dict(loss=loss / total, top1=top1 / total, top5=top5 / total, samples=int(total))


def score(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int, int]:
    """One batch's summed cross-entropy and how many of its samples are right at top-1 and at top-5."""
    best = logits.topk(min(5, logits.shape[1]), dim=1).indices
    return (F.cross_entropy(logits, labels, reduction="sum").item(), int((best[:, 0] == labels).sum()),
            int((best == labels[:, None]).any(dim=1).sum()))


def main(argv: list[str] | None = None) -> int:
    """`python -m hivetrain.evaluate --checkpoint PATH|s3://...`: a checkpoint's metrics on its validation split."""
    import argparse
    import json
    import logging
    import sys
    from pathlib import Path

    from hivetrain import require_extra

    require_extra("coordinator", "boto3")  # the checkpoint store's
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    # Imported here, not at the top: `from hivetrain.evaluate import evaluate` stays free of boto3 and Lightning.
    from hivetrain.checkpoint import CheckpointError
    from hivetrain.checkpoint_location import load_checkpoint
    from hivetrain.datasets import DatasetUnavailable, validation_loader

    parser = argparse.ArgumentParser(prog="python -m hivetrain.evaluate", description=main.__doc__)
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint file or s3://bucket/.../ckpt-N.tar; a checkpoint folder or "
                             "s3://bucket/prefix means its best checkpoint")
    parser.add_argument("--data-dir", default=None, help="where the dataset lives (default ~/.cache/hivetrain/data)")
    parser.add_argument("--val-limit", type=int, default=None, help="evaluate on the first N validation samples only")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the run's batch size")
    parser.add_argument("--out", type=Path, default=None, help="also write the metrics to this JSON file")
    parser.add_argument("--s3-endpoint-url", default=None,
                        help="an S3-compatible server (MinIO, SeaweedFS, ...); credentials come from the AWS chain")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        checkpoint = load_checkpoint(args.checkpoint, endpoint_url=args.s3_endpoint_url)
        model = checkpoint.build_model()
        metrics = evaluate(model, validation_loader(checkpoint.config, args.data_dir, batch_size=args.batch_size,
                                                    val_limit=args.val_limit))
    except NoCredentialsError:
        print("error: no AWS credentials for S3: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, use "
              "~/.aws/credentials (AWS_PROFILE), or an instance profile", file=sys.stderr)
        return 1
    except (CheckpointError, DatasetUnavailable, BotoCoreError, ClientError, ValueError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)  # one line, whatever the message holds
        return 1
    result = dict(checkpoint=args.checkpoint, run_id=checkpoint.config.run_id, epoch=checkpoint.epoch, **metrics)
    text = json.dumps(result, sort_keys=True)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
