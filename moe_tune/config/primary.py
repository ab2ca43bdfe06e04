"""Where the run's config is composed from: the packaged ``moe_tune/conf`` and its ``config``, or a config of the
user's own (``moe-tune --config-dir DIR --config-name NAME``), searched as ``hydra.main`` searches them, so that
the command-line check sees the config the run will get.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

from moe_tune.config.schema import ConfigError

# The configs ship inside the package, so an installed wheel finds them wherever it runs.
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


@dataclasses.dataclass(frozen=True)
class ConfigSource:
    """``config_dir``: ``--config-dir``'s directory, searched after the packaged configs (None: none given);
    ``config_name``: the primary config (``--config-name``)."""

    config_dir: str | None = None
    config_name: str = "config"

    @classmethod
    def of(cls, args) -> ConfigSource:
        """The source Hydra's parsed flags (``args``) name; ConfigError for a ``--config-dir`` that is no
        directory (Hydra's own words would be a multi-line error and exit 1)."""
        config_dir = None if args.config_dir is None else os.path.abspath(os.path.expanduser(args.config_dir))
        if config_dir is not None and not os.path.isdir(config_dir):
            raise ConfigError(f"--config-dir {args.config_dir} is not a directory; give the directory of your configs")
        return cls(config_dir, args.config_name or "config")


PACKAGED = ConfigSource()


@contextlib.contextmanager
def initialized(source: ConfigSource = PACKAGED):
    """Hydra initialised on the packaged configs and ``source.config_dir``, in hydra.main's order: the packaged
    ones first, then the user's, then the schema's structured configs."""
    from hydra import initialize_config_dir

    from moe_tune.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        if source.config_dir is not None:
            from hydra._internal.hydra import Hydra
            from hydra._internal.utils import create_config_search_path
            from hydra.core.config_search_path import SearchPathQuery
            from hydra.core.global_hydra import GlobalHydra

            GlobalHydra.instance().clear()  # initialize_config_dir's exit restores the Hydra found before it
            search_path = create_config_search_path(search_path_dir=CONF_DIR)
            search_path.prepend("command-line", f"file://{source.config_dir}", SearchPathQuery(provider="schema"))
            Hydra.create_main_hydra2(task_name="app", config_search_path=search_path)
        yield


def missing_primary(source: ConfigSource) -> str:
    """The line for a ``--config-name`` found in no directory searched."""
    where = CONF_DIR if source.config_dir is None else f"{source.config_dir} or {CONF_DIR}"
    return (
        f"--config-name {source.config_name}: no config {source.config_name}.yaml in {where}; give the name of a "
        "config file there (without .yaml), with --config-dir for a directory of your own"
    )


def without_schema(source: ConfigSource) -> str:
    """The line for a primary config that does not start from moe_tune's (its keys would go unchecked)."""
    return (
        f"--config-name {source.config_name}: the config does not start from moe_tune's, so its keys have no "
        f"schema to check them; put 'defaults: [config, _self_]' at the top of {source.config_name}.yaml"
    )


@functools.cache
def group_options(source: ConfigSource = PACKAGED) -> dict[str, list[str]]:
    """The user's config groups and their options (schema entries ``base_*`` left out), launchers included, a
    ``--config-dir``'s own options among them. Read once per process and source: the config directories do not
    change while it runs."""
    from hydra.core.global_hydra import GlobalHydra

    with initialized(source):
        loader = GlobalHydra.instance().config_loader()
        groups = [g for g in loader.list_groups("") if g != "hydra"] + ["hydra/launcher"]
        return {g: [o for o in loader.get_group_options(g) if not o.startswith("base_")] for g in groups}


__all__ = ["CONF_DIR", "PACKAGED", "ConfigSource", "group_options", "initialized", "missing_primary", "without_schema"]
