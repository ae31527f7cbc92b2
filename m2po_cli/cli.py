"""The `m2po` command line. Starts fast: torch and vLLM are imported only by commands that run them."""

from __future__ import annotations

import sys

import click

from m2po_cli.config import ConfigError, load_recipe, to_toml


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="m2po")
def main() -> None:
    """Off-policy RL for LLMs that tolerates stale rollouts (M2PO)."""


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a recipe key (repeatable).")
@click.option("--dry-run", is_flag=True, help="Print the fully resolved recipe and exit.")
def train(recipe: str, overrides: tuple[str, ...], dry_run: bool) -> None:
    """Train with a TOML RECIPE (run under torchrun for several processes)."""
    try:
        resolved = load_recipe(recipe, list(overrides))
    except ConfigError as e:
        _fail(str(e))
    if dry_run:
        click.echo(to_toml(resolved), nl=False)
        return
    from m2po_cli.data import DataError
    from m2po_cli.train import train as run_training

    try:
        run_training(resolved)
    except DataError as e:
        _fail(str(e))


def _fail(message: str) -> None:
    click.echo(message, err=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
