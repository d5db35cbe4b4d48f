"""How a benchmark section reports: the line naming the command that measured it, and each target's verdict."""


def verdict(met: bool, what: str) -> str:
    return f"{'**Met**' if met else '**Not met**'} ({what})."


def measured_by(env: dict) -> str:
    """The line every section opens with: `env` as render() gives it, with the command that measured the suite."""
    return (f"`{env['command']}` on {env['date']}, commit {env['commit']} ({env['machine']}; Python {env['python']},"
            f" torch {env['torch']}, hivemind {env['hivemind']}).")
