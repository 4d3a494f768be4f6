"""Options that several subcommands share, defined once."""

from __future__ import annotations

import click

#: ``--cluster ADDRESS``: read a run directory's rank streams on a Dask cluster.
cluster_option = click.option(
    "--cluster",
    metavar="ADDRESS",
    envvar="LORASCOPE_CLUSTER",
    default=None,
    help="Read a run directory's rank streams on the Dask cluster whose scheduler is at ADDRESS "
    "(tcp://host:8786; env LORASCOPE_CLUSTER). The workers need this lorascope and the run "
    "directory at the same path. Needs lorascope[cluster].",
)
