"""`keys`: the run's root and learner keys, and the signed registry of sampler and validator keys."""

from __future__ import annotations

from pathlib import Path

from heterorl.commands.common import add_config_args, load_run_config


def register_keys(sub) -> None:
    p = sub.add_parser("keys", help="signing keys: init the run's root/learner keys, add/revoke/list sampler keys",
                       description="Samplers sign every rollout with their own Ed25519 key; the learner accepts "
                                   "only keys in the run's registry, which the root key signs and Redis holds. "
                                   "See docs/security.md.")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = actions.add_parser("new", help="make a key pair on this machine and print its public half (for `keys add "
                                       "ID --public-key`): the private key never leaves the machine that signs with it")
    q.add_argument("file", metavar="FILE", help="where to write the private key (mode 0600; never overwritten)")
    q = actions.add_parser("init", help="make the root and learner keys (in security.keys_dir) if missing")
    add_config_args(q)
    q = actions.add_parser("add", help="register a sampler (or validator) key (a new key pair, or --public-key)")
    add_config_args(q)
    q.add_argument("sampler_id", metavar="ID", help="the id the sampler runs with (`heterorl sampler --id`), or the "
                                                    "validator's (`heterorl validator --id`)")
    q.add_argument("--role", choices=("sampler", "validator"), default="sampler",
                   help="what the key may sign: rollouts (sampler, the default) or verdicts on them (validator)")
    q.add_argument("--public-key", metavar="BASE64", help="register this public key instead of making a key pair")
    q.add_argument("--out", metavar="FILE", help="where to write the new private key "
                                                 "(default: <keys_dir>/<ROLE>s/<ID>.key)")
    q.add_argument("--days", type=float, metavar="N", help="lifetime (default: security.key_lifetime_days)")
    q = actions.add_parser("revoke", help="revoke a key (by key id, or every key of a sampler id)")
    add_config_args(q)
    q.add_argument("name", metavar="KEY_ID|SAMPLER_ID")
    q = actions.add_parser("list", help="the run's registered sampler and validator keys and their status")
    add_config_args(q)


def _cmd_keys(args) -> int:
    from heterorl import keys

    if args.action == "new":
        lines = keys.keys_new(Path(args.file))
    elif args.action == "init":
        lines = keys.keys_init(load_run_config(args, local_stack=False))
    elif args.action == "add":
        lines = keys.keys_add(load_run_config(args), args.sampler_id, public_key=args.public_key,
                              out=Path(args.out) if args.out else None, lifetime_days=args.days, role=args.role)
    elif args.action == "revoke":
        lines = keys.keys_revoke(load_run_config(args), args.name)
    else:
        lines = keys.keys_list(load_run_config(args))
    print("\n".join(lines))
    return 0


COMMANDS = {"keys": (register_keys, _cmd_keys)}
