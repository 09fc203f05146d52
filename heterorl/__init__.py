"""The `heterorl` commands: the top layer, which may import every other package.

    heterorl/    commands: CLI, train, chaos, study, compare, status, report,
                 process supervision, "use the stack or start one"
    producers/   the sampler role          (imports pipeline/ only)
    consumers/   learner, replay, evaluator (imports pipeline/ only)
    infra/       local stack, fault proxy   (imports pipeline/ only)
    pipeline/    the library                (imports nothing outside itself)

tests/unit/test_layers.py enforces these arrows.
"""
