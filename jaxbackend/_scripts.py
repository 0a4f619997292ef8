"""Load a function from a user's script: `path/to/script.py:name`.

Shared by `python -m jaxbackend explain` (the function to explain) and
`python -m jaxbackend train --model` (the model factory). The script runs as
a module with its own folder first on `sys.path`, so it can import its
neighbours, as `python path/to/script.py` would let it.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType


def load_callable(spec: str, what: str, error: type[Exception] = ValueError):
    """'path/to/script.py:name' -> (module, the callable `name`).

    `what` says in errors what the callable is for ("function", "model
    factory"); every failure raises `error` with one sentence and the fix."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise error(f"{spec!r} is not 'path/to/script.py:{what.split()[-1]}'; add ':<{what} name>' "
                    f"after the script path.")
    file = pathlib.Path(path)
    if not file.is_file():
        raise error(f"script {path!r} does not exist; give a path to a .py file.")
    module = load_module(file, "_jaxbackend_user_")
    if module is None:
        raise error(f"script {path!r} cannot be loaded as a module; give a .py file.")
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise error(f"{path} has no {what} {name!r}; callables there: {', '.join(found)}.")
    return module, fn


def load_module(file: pathlib.Path, prefix: str) -> ModuleType | None:
    """Runs `file` as the module `prefix + its stem`, its folder first on
    `sys.path`, registered in `sys.modules` (dataclasses and pickling look
    classes up there); None if it cannot be loaded as a module."""
    folder = str(file.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(prefix + file.stem, file)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
