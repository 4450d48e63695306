"""Where a sweep's Optuna study lives: an RDB URL (SQLite in the sweep folder by default, any
SQLAlchemy URL Optuna accepts with ``--storage``), opened only when it is empty or already an
Optuna storage, and a study that is this sweep's (same fingerprint) or new.

A file that is not SQLite, a database holding other tables, or a study made by another sweep is
refused with a SweepError and left exactly as it was: a storage is never overwritten or mixed.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from apr.errors import Finding
from apr.sweep.space import make_pruner, make_sampler, worker_stream
from apr.sweep.spec import SweepError, SweepSpec

SQLITE_MAGIC = b"SQLite format 3\x00"
OPTUNA_TABLES = {"studies", "trials", "version_info"}
SWEEP_ATTR = "apr_sweep"  # the study's user attribute holding what the sweep is (spec fingerprint, metric)


def default_url(sweep_dir: Path) -> str:
    return f"sqlite:///{Path(os.path.abspath(sweep_dir)) / 'study.db'}"


def _refuse(url: str, message: str, expected: str, got: str) -> SweepError:
    return SweepError(f"storage {display_url(url)}: {message}", [Finding(
        "error", "sweep.storage", message, path="--storage", file=display_url(url), expected=expected, got=got)])


def display_url(url: str) -> str:
    """The URL without its password (user:secret@host -> user:***@host)."""
    head, sep, rest = url.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        cred, at, host = rest.partition("@")
        user = cred.split(":", 1)[0]
        return f"{head}://{user}:***@{host}"
    return url


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///path`` URL, None for an in-memory or non-SQLite URL."""
    if not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def check_sqlite_file(url: str, path: Path) -> None:
    """A SQLite file that exists must be a SQLite database; its folder must exist."""
    if not path.parent.is_dir():
        raise _refuse(url, f"folder {path.parent} does not exist", "an existing folder", "no such folder")
    if not os.path.lexists(path):
        return
    if not path.is_file():
        raise _refuse(url, f"{path} is not a regular file", "a SQLite file", "something else")
    with open(path, "rb") as f:
        head = f.read(len(SQLITE_MAGIC))
    if head != SQLITE_MAGIC:
        got = "an empty file" if not head else "another kind of file"
        raise _refuse(url, f"{path} is not a SQLite database (corrupt, or another file): refused, left as it is",
                      "a SQLite database made by `apr sweep run`", got)


def check_tables(url: str) -> None:
    """The database holds Optuna's tables or none at all: a foreign database is refused (Optuna
    would add its tables beside the owner's), a corrupt one too."""
    import sqlalchemy  # lazy: Optuna's dependency, only for commands that open a storage

    try:
        engine = sqlalchemy.create_engine(url)
        try:
            tables = set(sqlalchemy.inspect(engine).get_table_names())
            if tables and url.startswith("sqlite"):
                with engine.connect() as conn:  # reads every page: a damaged file fails here, not mid-sweep
                    verdict = conn.exec_driver_sql("PRAGMA quick_check").scalar()
                if verdict != "ok":
                    raise _refuse(url, f"the database is damaged ({verdict})", "a sound database", str(verdict))
        finally:
            engine.dispose()
    except SweepError:
        raise
    except Exception as err:  # SQLAlchemy and every DB driver raise their own types
        raise _refuse(url, f"cannot be opened: {type(err).__name__}: {str(err).splitlines()[0][:200]}",
                      "a reachable database URL (sqlite:///path, postgresql://user@host/db, ...)",
                      type(err).__name__) from None
    if tables and not OPTUNA_TABLES <= tables:
        raise _refuse(url, f"the database holds other tables ({', '.join(sorted(tables)[:5])}): not an Optuna "
                      "storage; refused, left as it is", "an empty database or an Optuna storage",
                      f"{len(tables)} other table(s)")


def open_storage(url: str, *, heartbeat: int | None = None, grace: int | None = None, on_stale=None):
    """An Optuna RDBStorage at ``url`` after the checks above. ``heartbeat``: Optuna's
    heartbeat_interval in seconds (None: off); a RUNNING trial whose heartbeat is older than
    ``grace`` seconds is failed by the next worker that looks and handed to ``on_stale(study,
    frozen_trial)`` (Optuna's heartbeat_stale_trial_callback; apr.sweep.runner.StaleTrialRetry)."""
    import optuna

    path = sqlite_path(url)
    if path is not None:
        check_sqlite_file(url, path)
    check_tables(url)
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    beat = {} if not heartbeat else {"heartbeat_interval": heartbeat, "grace_period": grace,
                                     "heartbeat_stale_trial_callback": on_stale}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeat_interval
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, **beat)
    except Exception as err:  # version mismatches, drivers, permissions
        raise _refuse(url, f"cannot be opened: {type(err).__name__}: {str(err).splitlines()[0][:200]}",
                      "an Optuna storage this version can use", type(err).__name__) from None


def sweep_identity(spec: SweepSpec) -> dict:
    return {"fingerprint": spec.fingerprint(), "metric": spec.metric, "goal": spec.goal, "method": spec.method,
            "sweep_file": str(Path(os.path.abspath(spec.path)))}


def open_study(spec: SweepSpec, url: str, *, create: bool = True, worker: int = 0, heartbeat: int | None = None,
               grace: int | None = None, on_stale=None):
    """This sweep's study in the storage at ``url`` (made when ``create`` and absent). A study of the
    same name made by another sweep, or outside apr, is refused. ``worker``: this process's index
    among the workers started together (its sampler stream, apr.sweep.space.make_sampler);
    ``heartbeat``, ``grace``, ``on_stale``: see open_storage."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = sqlite_path(url)
    if not create and path is not None and not path.exists():
        raise _refuse(url, f"no sweep has run here yet ({path} does not exist)", "the storage of `apr sweep run`",
                      "no such file")
    storage = open_storage(url, heartbeat=heartbeat, grace=grace, on_stale=on_stale)
    names = {s.study_name for s in storage.get_all_studies()}
    if spec.name not in names and not create:
        raise _refuse(url, f"holds no sweep named {spec.name!r} (sweeps there: {', '.join(sorted(names)) or 'none'})",
                      f"a storage `apr sweep run` used for {spec.name}", "no such study")
    study = optuna.create_study(study_name=spec.name, storage=storage, sampler=make_sampler(spec),
                                pruner=make_pruner(spec), direction=spec.goal, load_if_exists=True)
    mine = sweep_identity(spec)
    theirs = study.user_attrs.get(SWEEP_ATTR)
    if theirs is None:
        if study.trials:
            raise _refuse(url, f"study {spec.name!r} was not made by `apr sweep run`; refused, left as it is",
                          "a study made by apr sweep", "a study without apr's identity")
        study.set_user_attr(SWEEP_ATTR, mine)
    elif theirs.get("fingerprint") != mine["fingerprint"]:
        raise _refuse(url, f"study {spec.name!r} holds another sweep (its method, metric, parameters, pruning or "
                      f"seed differ from {spec.path}); give this one another name or storage",
                      f"the sweep of {theirs.get('sweep_file')}", f"fingerprint {mine['fingerprint']}")
    study.sampler = make_sampler(spec, worker_stream(len(study.trials), worker))
    return study
