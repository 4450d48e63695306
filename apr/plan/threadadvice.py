"""More CPU threads than the cores they run on: the plan warns, naming where the count came from.
Torch-free. docs/performance.md, "CPU threads"."""

from __future__ import annotations

from apr.errors import Finding


def oversubscription_findings(loaded, choice: dict) -> list[Finding]:
    """A warning when this node's processes ask for more intra-op threads than it has usable cores
    (``choice``: apr.threads.choose's dict). Each extra thread waits for a core at every parallel
    region, so a step gets slower, not faster; the automatic choice never does this."""
    threads, ranks, cores = choice["threads"], choice["ranks_per_node"], choice["cores"]
    if threads * ranks <= cores or str(loaded.config.training.device) == "cuda":
        return []  # on a GPU the host's threads only feed the device
    source = choice["source"]
    if source == "training.cpu_threads":
        path, (file, line, column) = "training.cpu_threads", loaded.source.where(("training", "cpu_threads"))
    else:  # the environment: no file to point at
        path, file, line, column = source.removeprefix("env "), None, None, None
    per_node = f"{threads} x {ranks} ranks = {threads * ranks}" if ranks > 1 else str(threads)
    message = (f"{per_node} CPU threads on this node's {cores} usable core{'s' if cores != 1 else ''} "
               f"({choice['cores_from']}): oversubscribed, each extra thread waits for a core and the step gets "
               f"slower; leave the count to apr (unset {path}) or give at most "
               f"{max(1, cores // max(1, ranks))} per process")
    return [Finding("warning", "plan.threads_oversubscribed", message, path=path, file=file, line=line,
                    column=column, expected=f"at most {cores} threads on this node", got=str(threads * ranks))]
