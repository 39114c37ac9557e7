"""Reward plugins: modules that register rewards, named in the config or installed with an entry point.

* `reward.plugins: [my_pkg.rewards, ./my_rewards.py]` imports each entry once per process: a module name with
  importlib (it must be importable: installed, or on PYTHONPATH), a .py file from its path (config.py made it
  absolute when the config was read).
* An installed distribution registers without any config through the entry-point group `imagerl.rewards`, e.g. in
  its pyproject.toml: `[project.entry-points."imagerl.rewards"]` / `my_rewards = "my_pkg.rewards"`. Every such
  entry point is loaded the first time reward names are looked up (the same way pytest loads its plugins).

A plugin that fails to import raises ValueError naming it and where it failed, before any model loads.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from importlib.metadata import entry_points
from pathlib import Path

ENTRY_POINT_GROUP = "imagerl.rewards"

_loaded: set[str] = set()  # plugin entries (module names, absolute paths) imported in this process
_entry_points_loaded = False


def load_plugins(plugins: list[str]) -> None:
    """Import every reward.plugins entry not imported yet in this process."""
    from imagerl.config import absolute_plugin_path

    for plugin in map(absolute_plugin_path, plugins):
        if plugin in _loaded:
            continue
        if Path(plugin).is_absolute():
            _import_file(Path(plugin))
        else:
            _import_module(plugin)
        _loaded.add(plugin)


def load_entry_points() -> None:
    """Load the `imagerl.rewards` entry points of the installed distributions (once per process)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True  # one failure is reported once, not at every lookup
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "an installed distribution"
        try:
            ep.load()
        except Exception as e:  # noqa: BLE001 - any import failure, named
            raise ValueError(f"the reward plugin {ep.name} = {ep.value} (entry point group {ENTRY_POINT_GROUP!r} of "
                             f"{dist}) failed to import: {_failure(e)}; fix or uninstall {dist.split()[0]}") from e


def _import_module(name: str) -> None:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (e.name == name or name.startswith(e.name + ".")):  # the plugin, not its imports
            raise ValueError(f"reward.plugins: no module named {name!r}; a module must be importable (installed, or "
                             f"on PYTHONPATH); a file is given by its path, e.g. reward.plugins=[./{name}.py]") from e
        raise ValueError(f"reward.plugins: {name} failed to import: {_failure(e)}") from e
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"reward.plugins: {name} failed to import: {_failure(e)}") from e


def _import_file(path: Path) -> None:
    if not path.is_file():
        raise ValueError(f"reward.plugins: {path} is not a file (a relative path is read from the folder the command "
                         "runs in)")
    # a module name of its own per file (two plugins may both be called rewards.py), kept in sys.modules so that
    # pickling, dataclasses and `typing.get_type_hints` inside the plugin find it
    name = f"imagerl_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        del sys.modules[name]
        raise ValueError(f"reward.plugins: {path} failed to import: {_failure(e, path)}") from e


def _failure(e: BaseException, path: Path | None = None) -> str:
    """'NameError: name 'x' is not defined (my_rewards.py, line 12)': the error and the plugin's line that raised."""
    where = ""
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, SyntaxError) and e.filename:  # its str() holds the place already
        return f"{type(e).__name__}: {e.msg} ({Path(e.filename).name}, line {e.lineno})"
    if frames:
        ours = [f for f in frames if path is None or Path(f.filename) == path] or frames
        where = f" ({Path(ours[-1].filename).name}, line {ours[-1].lineno})"
    return f"{type(e).__name__}: {e}{where}"
