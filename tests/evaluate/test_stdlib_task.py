"""The shipped stdlib-nextline task: deterministic, four choices, the real next line is gold."""

from __future__ import annotations

from apr.data.corpus import stdlib_root
from apr.evaluate.stdlib_task import resolve_task, stdlib_nextline


def test_the_gold_choice_is_the_real_next_line_of_a_stdlib_module():
    task = stdlib_nextline(30, seed=1)
    assert task.name == "stdlib-nextline" and len(task.examples) == 30
    for ex in task.examples:
        assert len(ex.choices) == 4 and len(set(ex.choices)) == 4
        rel, line = ex.id.rsplit(":", 1)
        lines = (stdlib_root() / rel).read_text(encoding="utf-8").splitlines()
        n = int(line)  # 1-based number of the gold line
        assert ex.choices[ex.gold] == lines[n - 1].rstrip()
        assert ex.context == "\n".join(lines[max(0, n - 7):n - 1]) + "\n"
    golds = [ex.gold for ex in task.examples]
    assert len(set(golds)) > 1  # the right answer is not always in the same place


def test_the_same_seed_gives_the_same_task_and_another_seed_another():
    assert stdlib_nextline(10, seed=3).examples == stdlib_nextline(10, seed=3).examples
    assert stdlib_nextline(10, seed=3).examples != stdlib_nextline(10, seed=4).examples
    assert len(resolve_task("stdlib-nextline", limit=7).examples) == 7
