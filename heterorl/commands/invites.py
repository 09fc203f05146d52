"""`invite` and `join`: a volunteer's host joins a run with one line of text (heterorl/invites.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from heterorl.commands.common import add_config_args, load_run_config
from pipeline.config import ConfigError

DEFAULT_JOIN_HOME = ".heterorl/joined"


def register_invite(sub) -> None:
    p = sub.add_parser("invite", help="make an invite: one line with which volunteers join the run as samplers",
                       description="Run where the run's root key is. Prints one line (the invite) holding the "
                                   "servers' URLs and the sampler role's credentials, the CA certificate where TLS "
                                   "is on, the learner's public key, the run's config and a grant the root key "
                                   "signs: how many samplers may join with it and until when, never as the run's "
                                   "own (their groups are checked). A volunteer runs `heterorl join INVITE`; the "
                                   "learner admits it with no one's action. See docs/security.md, \"Invites\".")
    add_config_args(p)
    p.add_argument("--joins", type=int, default=1, metavar="N", help="how many samplers may join with it (default 1)")
    p.add_argument("--hours", type=float, default=24.0, metavar="H",
                   help="hours during which it admits new samplers (default 24; those joined stay until revoked)")
    p.add_argument("--out", metavar="FILE", help="also write the invite to FILE (mode 0600)")
    p.add_argument("--revoke", metavar="INVITE_ID", help="revoke an invite instead: no one joins with it any "
                                                          "more, and every sampler that joined with it is refused")


def _cmd_invite(args) -> int:
    from heterorl import invites
    from heterorl.keys import _redis

    cfg = load_run_config(args)
    if args.revoke:
        print("\n".join(invites.revoke_invite(cfg, _redis(cfg), args.revoke)))
        return 0
    text, _, lines = invites.make_run_invite(cfg, load_run_config(args, role="sampler"), args.joins, args.hours)
    if args.out:
        out = Path(args.out)
        invites.write_invite_file(out, text)
        lines.append(f"wrote {out} (mode 0600): `heterorl join --invite {out}`")
    print("\n".join(lines), file=sys.stderr)
    print(text)
    return 0


def register_join(sub) -> None:
    p = sub.add_parser("join", help="join a run as a sampler with an invite (`heterorl invite` made it)",
                       description="On the volunteer's host, after `make install`: makes this host's own key (its "
                                   "private half never leaves the host), asks the run's learner to admit it under "
                                   "the invite, fetches and verifies the newest policy and samples. Ctrl-C leaves "
                                   "(lease released, groups not sent kept); running it again resumes as the same "
                                   "sampler. --config and --set change this sampler's fields (device, backend, "
                                   "precision, ...); the run's config, servers and keys come with the invite.")
    p.add_argument("invite", nargs="?", metavar="INVITE", help="the invite's line (or --invite FILE)")
    p.add_argument("--invite", dest="invite_file", metavar="FILE", help="a file holding the invite")
    p.add_argument("--config", "-c", metavar="NAME|FILE",
                   help="YAML of fields to change for this host (sampler, model, task sections)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="change a field for this host, e.g. --set sampler.backend=vllm (repeatable)")
    p.add_argument("--id", dest="sampler_id", metavar="ID",
                   help="the sampler id to join as (default: HOSTNAME-KEYID; a resumed join keeps its own)")
    p.add_argument("--home", default=DEFAULT_JOIN_HOME, metavar="DIR",
                   help=f"where this host keeps its key, id and spool per run (default {DEFAULT_JOIN_HOME}/)")


def _cmd_join(args) -> int:
    from heterorl import invites

    if bool(args.invite) == bool(args.invite_file):
        raise ConfigError("give the invite once: as INVITE, or as --invite FILE")
    text = invites.read_invite_file(Path(args.invite_file)) if args.invite_file else args.invite
    return invites.join(text, base=Path(args.home), config_file=args.config, overrides=args.overrides,
                        sampler_id=args.sampler_id)


COMMANDS = {"invite": (register_invite, _cmd_invite), "join": (register_join, _cmd_join)}
