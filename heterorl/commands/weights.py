"""`weights fetch`: a published version as a plain Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

from heterorl.commands.common import add_config_args, load_run_config


def register_weights(sub) -> None:
    p = sub.add_parser("weights", help="published policy weights: take any version home as a plain model directory")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = actions.add_parser("fetch", help="rebuild a published version (keyframe or delta) into a Hugging Face directory",
                           description="Downloads the version's keyframe and deltas (or its full copy), rebuilds the "
                                       "weights, checks every tensor bit for bit against the sha256 its manifest "
                                       "names (signed by the learner when security.require_signatures), and writes "
                                       "a directory that transformers loads. Nothing is written unless it verifies.")
    add_config_args(p)
    p.add_argument("url", metavar="s3://BUCKET/RUN/vN/", help="the version, as `heterorl train` prints it")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (replaced if it exists)")


def _cmd_weights(args) -> int:
    cfg = load_run_config(args)
    from pipeline.weights.store import connect_s3
    from pipeline.trust.keyring import trusted_learner
    from pipeline.clients.services import require_services
    from pipeline.weights.policy import fetch_published

    trusted = trusted_learner(cfg)
    client = connect_s3(require_services(cfg.services), timeout_s=cfg.services.connect_timeout_s)
    path, manifest, report = fetch_published(client, args.url, Path(args.out), trusted=trusted)
    print(f"wrote {path}: policy v{manifest.version} of run {manifest.run}, every tensor verified "
          f"(downloaded {' -> '.join(f'v{v}' for v in report.path)}, {report.bytes_downloaded / 1e6:.1f} MB)")
    return 0


COMMANDS = {"weights": (register_weights, _cmd_weights)}
