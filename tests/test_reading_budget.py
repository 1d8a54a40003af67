"""The course stays minimal: each lesson's reading path within its budget, the shared course
code and the whole course within theirs, and the course pointing one way (never at the lab).

Definitions (the same as ``shared/tools/reading_path.py``):
- a lesson is a numbered folder holding .py files and no numbered sub-folder;
- the lab is every folder named lab, bench, measure or tests; the course is every other .py;
- a lesson's reading path is its own .py files plus the shared course files they import,
  transitively, that no earlier lesson's path held; lines are physical lines;
- no course file imports a lab module or names a lab .py file in a string (docstrings aside).
"""

import ast
import os
import re
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAB = {"lab", "bench", "measure", "tests"}
SKIP = {".git", ".venv", "__pycache__", "results", "node_modules"}
NUMBERED = re.compile(r"^\d\d_")
# "everything": all non-test Python, course and lab.
BUDGET = {"early": 800, "lesson": 1100, "median": 700, "shared": 450, "course": 10500,
          "everything": 19000}


def python_files():
    found = []
    for folder, dirs, names in os.walk(REPO):
        dirs[:] = sorted(d for d in dirs if d not in SKIP and not d.startswith("."))
        found += [Path(folder, n).relative_to(REPO).as_posix() for n in sorted(names)
                  if n.endswith(".py")]
    return found


def in_lab(path):
    return any(part in LAB for part in path.split("/")[:-1])


def numbered(path):
    return any(NUMBERED.match(part) for part in path.split("/")[:-1])


def lines(path):
    with open(REPO / path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def imports(tree):
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def module_index(files):
    """Dotted name -> file, for the files outside the lessons (shared code and lab)."""
    index = {}
    for path in files:
        if numbered(path):
            continue
        dotted = path[:-3].replace("/", ".")
        index[dotted] = path
        if dotted.endswith(".__init__"):
            index[dotted[:-len(".__init__")]] = path
        index.setdefault(path.split("/")[-1][:-3], path)  # a sibling import after a sys.path edit
    return index


def resolve(name, index):
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in index:
            return index[".".join(parts[:k])]
    return None


def strings_naming(tree, lab_files):
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    named = set()
    for node in ast.walk(tree):
        if id(node) in docstrings or not isinstance(node, ast.Constant):
            continue
        if isinstance(node.value, str):
            named |= {lab for lab in lab_files if lab in node.value
                      or (node.value.endswith(".py") and lab.endswith("/" + node.value))}
    return named


def measure():
    files = python_files()
    lab_files = [f for f in files if in_lab(f)]
    course = [f for f in files if not in_lab(f)]
    index = module_index(files)
    trees = {f: ast.parse((REPO / f).read_text(encoding="utf-8")) for f in course}
    folders = sorted({os.path.dirname(f) for f in course
                      if NUMBERED.match(os.path.basename(os.path.dirname(f)) or "-")})
    lessons = [l for l in folders if not any(os.path.dirname(o) == l for o in folders)]
    paths, met = {}, set()
    for lesson in lessons:
        own = [f for f in course if os.path.dirname(f) == lesson]
        shared, todo = set(), list(own)
        while todo:
            for name in imports(trees[todo.pop()]):
                hit = resolve(name, index)
                if hit and hit not in own and hit not in shared and not in_lab(hit):
                    shared.add(hit)
                    todo.append(hit)
        paths[lesson] = sum(map(lines, own)) + sum(map(lines, shared - met))
        met |= shared
    backwards = []
    for f in course:
        backwards += [f"{f} imports {hit}" for hit in map(lambda n: resolve(n, index),
                                                          imports(trees[f]))
                      if hit and in_lab(hit)]
        backwards += [f"{f} names {lab}" for lab in strings_naming(trees[f], lab_files)]
    return {"paths": paths,
            "shared": sum(lines(f) for f in course if not numbered(f)),
            "course": sum(map(lines, course)),
            "everything": sum(lines(f) for f in files if not f.startswith("tests/")),
            "backwards": sorted(set(backwards))}


def test_each_lesson_and_the_course_stay_within_their_reading_budgets():
    figures = measure()
    over = []
    for lesson, total in figures["paths"].items():
        budget = BUDGET["lesson"] if lesson.startswith("07_") else BUDGET["early"]
        if total > budget:
            over.append(f"{lesson}: {total} > {budget}")
    median = statistics.median(figures["paths"].values())
    for what, value in (("median", median), ("shared", figures["shared"]),
                        ("course", figures["course"]), ("everything", figures["everything"])):
        if value > BUDGET[what]:
            over.append(f"{what}: {value:.0f} > {BUDGET[what]}")
    assert not over, over
    assert len(figures["paths"]) >= 17, figures["paths"]  # every lesson was found


def test_the_course_never_points_into_the_lab():
    assert measure()["backwards"] == []


def test_the_measure_sees_a_planted_lab_import(tmp_path, monkeypatch):
    """The negative control: a course file that imports the lab is caught, and a lesson over
    its budget is reported over it."""
    planted = REPO / "07_parallelism" / "01_zero" / "zz_planted.py"
    planted.write_text("from bench import results\n" + "x = 1\n" * 1200)
    try:
        figures = measure()
    finally:
        planted.unlink()
    assert any("zz_planted.py imports bench/results.py" in b for b in figures["backwards"])
    assert figures["paths"]["07_parallelism/01_zero"] > BUDGET["lesson"]


# torch's own parallel machinery whose collectives Gloo cannot carry with CUDA tensors (sends,
# coalesced ops): every file that builds one asks the one rule first.
TORCH_PARALLEL = {"pipelining", "parallelize_module", "distribute_tensor", "DTensor",
                  "fully_shard", "_functional_collectives", "PipelineStage"}


def test_every_use_of_torchs_parallel_machinery_is_guarded_by_the_one_rule():
    """On one GPU the ranks share it over Gloo, whose send/recv and coalesced collectives take
    CUDA tensors without a device check ("writev: Bad address", or a segfault): the pipeline
    bench crashed there. Every course or lab file (tests aside: they run on the CPU) that
    builds torch's pipelining, DTensor, parallelize_module, fully_shard or functional
    collectives calls ``common.launch.carries_point_to_point``."""
    def names_in(path):
        tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {a.name.split(".")[-1] for a in node.names}
                names |= set((getattr(node, "module", None) or "").split("."))
        return names

    files = [p for p in python_files() if not p.startswith("tests/") and p != "common/launch.py"]
    unguarded = []
    for path in files:
        names = names_in(path)
        # a lesson's algorithm file stays copyable alone (torch only): its demo asks the rule
        askers = [path] if in_lab(path) or not numbered(path) else \
            [p for p in files if os.path.dirname(p) == os.path.dirname(path)]
        if names & TORCH_PARALLEL and not any("carries_point_to_point" in names_in(p)
                                              for p in askers):
            unguarded.append(f"{path}: {sorted(names & TORCH_PARALLEL)}")
    assert not unguarded, unguarded


def test_the_root_readme_states_each_lessons_reading_path():
    """The root README's "lines" column is each lesson's reading path as measured here."""
    rows = re.findall(r"^\| \[([\w/]+)\]\(\1/\) \| [^|]+ \| (\d+) \|",
                      (REPO / "README.md").read_text(encoding="utf-8"), re.MULTILINE)
    stated = {lesson: int(n) for lesson, n in rows}
    assert stated == measure()["paths"], stated


def test_each_readmes_reading_order_states_its_files_lines():
    """Every "| `file.py` | lines |" row and "`file.py` (N lines" in a README is that file's
    length today (the reading order a learner plans an evening by)."""
    wrong = []
    for folder, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP and not d.startswith(".")]
        if "README.md" not in names:
            continue
        text = Path(folder, "README.md").read_text(encoding="utf-8")
        stated = re.findall(r"\|\s*\[?`([\w/]+\.py)`(?:\]\([^)]*\))?\s*\|\s*(\d+)\s*\|", text)
        stated += re.findall(r"`([\w/]+\.py)` \((\d+) lines", text)
        for name, n in stated:
            path = next((p for p in (Path(folder, name), REPO / name) if p.is_file()), None)
            if path is None or sum(1 for _ in open(path, encoding="utf-8")) != int(n):
                wrong.append(f"{Path(folder, 'README.md').relative_to(REPO)}: {name} {n}")
    assert not wrong, wrong
