"""Every command written in README.md, docs/*.md, experiments/RESULTS.md and the notebooks' text runs as
written, as far as can be checked without running it.

The files are read when the test runs, so the test checks whatever the tree holds then. A command is a
line of a code block, or an inline code span, that starts (after `NAME=value` environment settings) with
python, bash, source, sbatch, pip, pytest or jupyter. For each one:

- the script, module, notebook or test file it names exists (`python path/x.py`, `python -m pkg.mod`,
  `bash scripts/x.sh`, `jupyter execute x.ipynb`), and a notebook section that execute_cells.py is told
  to run has a heading with that text;
- every `--flag` given to a script or module of this repository is defined by it (argparse's
  `add_argument` or absl's `DEFINE_*`, in the file or in the repository modules it imports);
- `--config=FILE[:ARG]` names a config file that loads with that argument, every `--config.X=V` is a
  field of the config it builds (for noloco_jax.main, after launch_local's `--` too), and the config with
  all its overrides passes the schema's validation;
- a script on the benchmark harness (experiments/lib/harness.py) takes `--config.X=V` only when it
  declares config overrides (`Bench(config=True)`; the config file defaults to the harness's
  configs/default.py) and `--G.X=V` for each override group G it declares (bench_ab's `--a.` / `--b.`);
  each names a field of the schema and a value of its type (the harness's own parser decides);
- `pip install ".[extra]"` names extras that setup.py declares.

A `--config.X=V` anywhere else in a code span (a flag quoted in prose) must name a field of the schema,
and every repository file README.md and docs/ name (`noloco_jax/outer/x.py`, `outer/x.py`, ...) exists.
Templates (`[--config.FIELD=VALUE ...]`, `a|b`, upper-case placeholders such as WORKDIR) are checked
where they are concrete. No command is run: the test takes a few seconds.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import importlib.util
import os
import re
import shlex

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = ("python", "python3", "bash", "sh", "source", "sbatch", "pip", "pytest", "jupyter")
# absl's own flags, accepted by every absl program.
ABSL_FLAGS = {"help", "helpfull", "helpshort", "flagfile", "logtostderr", "alsologtostderr", "log_dir", "v",
              "verbosity", "stderrthreshold", "only_check_args"}


def documents() -> list[str]:
  files = ["README.md", "experiments/RESULTS.md", *sorted(glob.glob("docs/*.md", root_dir=REPO)),
           *sorted(glob.glob("experiments/ablations/*.ipynb", root_dir=REPO))]
  return [f for f in files if os.path.exists(os.path.join(REPO, f))]


def _markdown(path: str) -> str:
  with open(os.path.join(REPO, path), encoding="utf-8") as f:
    if not path.endswith(".ipynb"):
      return f.read()
    import json
    cells = json.load(f)["cells"]
  return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


@dataclasses.dataclass(frozen=True)
class Snippet:
  where: str  # file:line
  text: str  # one logical line of a code block, or one inline code span


def snippets(path: str) -> list[Snippet]:
  """The code of a markdown text: each logical line of fenced and indented blocks, each inline span."""
  text = _markdown(path)
  out, lines = [], text.split("\n")
  fenced, i = False, 0
  prose = []  # (line number, line) outside code blocks, for the inline spans
  while i < len(lines):
    line = lines[i]
    if line.lstrip().startswith("```"):
      fenced = not fenced
      i += 1
      continue
    indented = not fenced and re.match(r"^( {4,}|\t)\S", line) and (i == 0 or not lines[i - 1].strip() or
                                                                    lines[i - 1].startswith((" " * 4, "\t")))
    if fenced or indented:
      start, logical = i, line
      while logical.rstrip().endswith("\\") and i + 1 < len(lines):
        i += 1
        logical = logical.rstrip()[:-1] + " " + lines[i].strip()
      if fenced or _commands_of(logical):  # an indented line: a code block only if it is a command
        out.append(Snippet(f"{path}:{start + 1}", logical.strip()))
      else:
        prose += [(n, lines[n]) for n in range(start, i + 1)]
    else:
      prose.append((i, line))
    i += 1
  # Inline spans may wrap across lines of a paragraph (never across a blank line).
  joined, numbers = "", []
  for n, line in prose:
    joined += line + "\n"
    numbers.append((len(joined), n))
  for m in re.finditer(r"(?<!`)`([^`]+?)`(?!`)", joined):
    if "\n\n" in m.group(1):
      continue
    line_no = next(n for end, n in numbers if end > m.start()) + 1
    out.append(Snippet(f"{path}:{line_no}", " ".join(m.group(1).split())))
  return out


def _split(text: str) -> list[str]:
  try:
    return shlex.split(text, comments=True)
  except ValueError:
    return text.split()


def _commands_of(text: str) -> list[list[str]]:
  found, current = [], []
  tokens = _split(text)
  for token in tokens + ["&&"]:
    end = token in ("&&", "||", "|", ";") or token.endswith(";")
    if token.endswith(";") and token != ";":
      current.append(token[:-1])
    elif not end:
      current.append(token)
    if end:
      while current and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", current[0]):
        current = current[1:]  # environment settings
      if current and current[0].startswith("(") and len(current[0]) > 1:
        current[0] = current[0][1:]
      if current and os.path.basename(current[0]) in PROGRAMS:
        found.append(current)
      for t in current:  # a command quoted inside another (ssh's --command="...")
        m = re.fullmatch(r"--command=(.*)", t, re.S)
        if m:
          found += _commands_of(m.group(1))
      current = []
  return found


def commands(snippet: Snippet) -> list[list[str]]:
  """The commands of a snippet (split at && ; | ||), each a token list starting with its program."""
  return _commands_of(snippet.text)


def is_template(token: str) -> bool:
  """A placeholder in a syntax description, not a value: [optional], a|b, FIELD, VALUE, PATH, ..."""
  return bool(re.search(r"[\[\]|…<>]|\.\.\.|\b(?:FIELD|VALUE|NAME|PATH|WORKDIR|DIR|TEXT|OLD|NEW)\b", token))


# ---- What exists: modules, flags, config fields ----


def module_file(module: str) -> str | None:
  base = os.path.join(REPO, *module.split("."))
  for candidate in (base + ".py", os.path.join(base, "__main__.py"), os.path.join(base, "__init__.py")):
    if os.path.exists(candidate):
      return candidate
  return None


def _repo_imports(tree: ast.AST) -> list[str]:
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
  return [n for n in names if n.split(".")[0] in ("noloco_jax", "configs", "experiments")]


_FLAG_CACHE: dict[str, set[str]] = {}
_CONFIG_DEFAULT: dict[str, str] = {}  # program file -> its --config flag's default config file
_OVERRIDE_GROUPS: dict[str, tuple[str, ...]] = {}  # harness script -> its override groups ("config", "a", ...)


def _harness_declaration(path: str, tree: ast.AST) -> None:
  """Records what a script's `harness.Bench(...)` declares: config overrides and their default file,
  and extra override groups."""
  for node in ast.walk(tree):
    if not (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "Bench"):
      continue
    kw = {k.arg: k.value for k in node.keywords}
    config = isinstance(kw.get("config"), ast.Constant) and kw["config"].value is True
    groups = [e.value for e in getattr(kw.get("groups"), "elts", []) if isinstance(e, ast.Constant)]
    _OVERRIDE_GROUPS[path] = (("config",) if config else ()) + tuple(groups)
    if config or "config" in groups:  # a `config` group's overrides are checked against the schema's defaults too
      from experiments.lib import harness  # pylint: disable=g-import-not-at-top
      _CONFIG_DEFAULT[path] = harness.DEFAULT_CONFIG


def defined_flags(path: str) -> set[str]:
  """Flag names (no dashes) that `path` and the repository modules it imports define."""
  if path in _FLAG_CACHE:
    return _FLAG_CACHE[path]
  seen, todo, names = set(), [path], set()
  while todo:
    file = todo.pop()
    if file in seen:
      continue
    seen.add(file)
    with open(file, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    if file == path:
      _harness_declaration(path, tree)
    for node in ast.walk(tree):
      if not isinstance(node, ast.Call):
        continue
      func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
      strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
      if func == "add_argument":
        names |= {s.lstrip("-") for s in strings if s.startswith("-")}
        names |= {s.replace("-", "_") for s in names}
      elif func.startswith("DEFINE") and strings:
        names.add(strings[0])
        default = node.args[1] if len(node.args) > 1 else None
        if func == "DEFINE_config_file" and isinstance(default, ast.Constant) and isinstance(default.value, str):
          _CONFIG_DEFAULT[path] = default.value
        if "bool" in func:
          names.add("no" + strings[0])
    for module in _repo_imports(tree):
      file = module_file(module)
      if file:
        todo.append(file)
  _FLAG_CACHE[path] = names
  return names


def load_config(spec: str):
  """The ConfigDict of `--config=FILE[:ARG]` (FILE relative to the repository root)."""
  file, _, arg = spec.partition(":")
  loader = importlib.util.spec_from_file_location("noloco_doc_config", os.path.join(REPO, file))
  module = importlib.util.module_from_spec(loader)
  loader.loader.exec_module(module)
  return module.get_config(arg or None)


def has_field(config, dotted: str) -> bool:
  node = config
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node.keys():
      return False
    node = node[part]
  return True


def set_field(config, dotted: str, value: str) -> None:
  """config.dotted = value, typed as the command line types it (the harness's parser, which reads the
  field's declared type: a field whose default is None still has one); ConfigError when it can't be."""
  from experiments.lib import harness  # pylint: disable=g-import-not-at-top
  harness.apply_overrides(config, [f"{dotted}={value}"])


# ---- Checking one command ----


def check_command(tokens: list[str]) -> list[str]:
  """What is wrong with one command (empty: nothing found)."""
  program, args = os.path.basename(tokens[0]), tokens[1:]
  if program in ("bash", "sh", "source", "sbatch"):
    script = next((a for a in args if not a.startswith("-")), None)
    if script is None or is_template(script) or script.startswith(("$", ".venv/")):
      return []  # .venv/bin/activate: made by the install the command follows
    problems = [] if os.path.exists(os.path.join(REPO, script)) else [f"{script} does not exist"]
    rest = args[args.index(script) + 1:]
    if script.endswith("slurm_gpu.sbatch") or script.endswith("run_default.sh"):
      problems += check_main_args(["--config=configs/default.py"] + rest, implicit_config=True)
    return problems
  if program == "pip":
    problems = []
    for a in args:
      m = re.fullmatch(r"\.\[([\w,-]+)\]", a)
      if m:
        with open(os.path.join(REPO, "setup.py"), encoding="utf-8") as f:
          setup = f.read()
        problems += [f"setup.py has no extra {e!r}" for e in m.group(1).split(",") if f'"{e}":' not in setup]
    return problems
  if program == "jupyter":
    return [f"{a} does not exist" for a in args if a.endswith(".ipynb") and not os.path.exists(os.path.join(REPO, a))]
  if program == "pytest":
    return check_pytest(args)
  # python: its own options first
  while args and args[0] in ("-X", "-W") + tuple(f"-{o}" for o in "uOBEIsS"):
    args = args[2:] if args[0] in ("-X", "-W") else args[1:]
  if not args or args[0] == "-c":
    return []
  if args[0] == "-m":
    module, rest = args[1], args[2:]
    if module == "pytest":
      return check_pytest(rest)
    file = module_file(module)
    if file is None:
      if module.split(".")[0] in ("noloco_jax", "configs", "experiments", "scripts", "tests"):
        return [f"python -m {module}: no such module"]
      return [] if importlib.util.find_spec(module.split(".")[0]) else [f"python -m {module}: not installed"]
  else:
    script, rest = args[0], args[1:]
    if is_template(script):
      return []
    file = os.path.join(REPO, script)
    if not os.path.exists(file):
      return [f"{script} does not exist"]
    if script.endswith("execute_cells.py") and len(rest) >= 2 and os.path.exists(os.path.join(REPO, rest[0])):
      heading = rest[1]
      if not any(line.startswith("#") and heading in line for line in _markdown(rest[0]).splitlines()):
        return [f"{rest[0]} has no markdown heading containing {heading!r}"]
  main_args, tail = rest, []
  if "--" in rest:  # launch_local: what follows goes to noloco_jax.main
    main_args, tail = rest[:rest.index("--")], rest[rest.index("--") + 1:]
  problems = check_flags(file, main_args)
  if tail:  # to noloco_jax.main, or to launch_local's --module=M
    target = next((a.split("=", 1)[1] for a in main_args if a.startswith("--module=")), "noloco_jax.main")
    target_file = module_file(target)
    problems += check_flags(target_file, tail) if target_file else [f"--module={target}: no such module"]
  return problems


def check_pytest(args: list[str]) -> list[str]:
  paths = [a.split("::")[0] for a in args if not a.startswith("-") and (a.startswith("tests") or a.endswith(".py"))]
  return [f"{p} does not exist" for p in paths if not os.path.exists(os.path.join(REPO, p))]


def check_flags(file: str, args: list[str]) -> list[str]:
  defined = defined_flags(file) | ABSL_FLAGS
  groups = _OVERRIDE_GROUPS.get(file)  # None: not on the harness (noloco_jax.main: absl's config flags)
  problems = []
  for a in args:
    m = re.fullmatch(r"--([\w-]+)(?:[=.].*)?", a)
    if not m or is_template(m.group(1)):
      continue
    group = a[2:].split(".")[0] if re.match(r"--\w+\.", a) else None
    if group is not None and groups is not None:
      if group not in groups:
        problems.append(f"{os.path.relpath(file, REPO)} takes no --{group}.FIELD overrides"
                        + (f" (it takes {', '.join(f'--{g}.' for g in groups)})" if groups else ""))
      elif group != "config":
        problems += check_group_override(a)
      continue
    if a.startswith("--config."):
      continue
    if m.group(1) not in defined:
      problems.append(f"{os.path.relpath(file, REPO)} defines no flag --{m.group(1)}")
  uses_config = "config" in groups if groups is not None else "config" in defined
  if uses_config and not any(a in ("...", "…") for a in args):  # "...": the rest left out
    problems += check_main_args(args, default=_CONFIG_DEFAULT.get(file))
  return problems


def check_main_args(args: list[str], implicit_config: bool = False, default: str | None = None) -> list[str]:
  """`--config=FILE[:ARG]` loads, every `--config.X=V` is a field of it, and the result validates."""
  from noloco_jax import config as config_lib
  spec = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), default)
  overrides = [a[len("--config."):].split("=", 1) for a in args if a.startswith("--config.")]
  if spec is None:
    return [f"--config.{o[0]} without --config=FILE" for o in overrides]
  file = spec.partition(":")[0]
  if is_template(file) or file.startswith("$"):
    return []
  if not os.path.exists(os.path.join(REPO, file)):
    return [f"--config={spec}: {file} does not exist"]
  if is_template(spec):
    return []
  try:
    config = load_config(spec)
  except Exception as e:  # pylint: disable=broad-except
    return [f"--config={spec} does not load: {e}"]
  problems = []
  for o in overrides:
    if not has_field(config, o[0]):
      problems.append(f"--config.{o[0]} is not a field of the config {spec}")
    elif len(o) == 2 and not is_template(o[1]) and not o[1].startswith("$"):
      try:
        set_field(config, o[0], o[1])
      except (TypeError, ValueError, config_lib.ConfigError) as e:
        problems.append(f"--config.{o[0]}={o[1]}: {e}")
  concrete = all(len(o) == 2 and not is_template(o[1]) and not o[1].startswith("$") for o in overrides)
  if not problems and concrete and not implicit_config:
    try:
      config_lib.validate(config)
    except config_lib.ConfigError as e:
      problems.append(f"the config does not validate: {e}")
  return problems


def check_group_override(flag: str) -> list[str]:
  """An override of another group (bench_ab's `--a.FIELD=VALUE`): FIELD is a field of the schema and
  VALUE has its type."""
  from noloco_jax import config as config_lib
  item = flag[2:].split(".", 1)[1]
  field, _, value = item.partition("=")
  if is_template(item):
    return []
  config = config_lib.default_config_dict()
  if not has_field(config, field):
    return [f"{flag}: {field} is not a field of the schema"]
  try:
    set_field(config, field, value)
  except (TypeError, ValueError, config_lib.ConfigError) as e:
    return [f"{flag}: {e}"]
  return []


def check_config_mention(text: str) -> list[str]:
  """A `--config.X` quoted in prose, outside a command: X must be a field of the schema."""
  from noloco_jax import config as config_lib
  schema = config_lib.default_config_dict()
  return [f"--config.{f} is not a field of the schema" for f in re.findall(r"--config\.([\w.]+)", text)
          if not is_template(f) and not has_field(schema, f.rstrip("."))]


def all_commands():
  for path in documents():
    for snippet in snippets(path):
      cmds = commands(snippet)
      for tokens in cmds:
        yield snippet, tokens
      if not cmds:
        yield snippet, None


def problems_in_the_tree() -> list[str]:
  found = []
  for snippet, tokens in all_commands():
    issues = check_command(tokens) if tokens else check_config_mention(snippet.text)
    found += [f"{snippet.where}: {issue}   [{snippet.text[:160]}]" for issue in issues]
  return found


_SUBPACKAGES = "outer|training|io|parallel|models|inner|tools|runtime|config"
_FILE = re.compile(r"(?<![\w/.])((?:noloco_jax|experiments|configs|scripts|tests|docs|%s)/[\w/.\-]*\w"
                   r"\.(?:py|md|sh|ipynb|sbatch))\b" % _SUBPACKAGES)


def missing_files(path: str) -> list[str]:
  """Files a README, docs/ page or RESULTS.md names (`outer/x.py` meaning noloco_jax/outer/x.py) that do
  not exist. (RESULTS.md names a removed script without its folder, with the commit that has it.)"""
  text, found = _markdown(path), []
  for m in _FILE.finditer(text):
    name = m.group(1)
    if not any(os.path.exists(os.path.join(REPO, p, name)) for p in ("", "noloco_jax", "docs")):
      found.append(f"{path}:{text[:m.start()].count(chr(10)) + 1}: {name} does not exist")
  return found


# ---- The tests ----


def test_every_documented_command_names_what_exists():
  problems = problems_in_the_tree()
  assert not problems, "\n" + "\n".join(problems)


def test_every_file_the_readme_docs_and_results_name_exists():
  pages = ["README.md", "experiments/RESULTS.md"] + [p for p in documents() if p.startswith("docs/")]
  problems = [issue for page in pages for issue in missing_files(page)]
  assert not problems, "\n" + "\n".join(problems)


def _anchor(heading: str) -> str:
  """The anchor a markdown renderer gives a heading: lower case, punctuation dropped, spaces to hyphens."""
  return "#" + re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_results_contents_list_every_topic_in_order():
  """experiments/RESULTS.md is by topic: its contents list links every `##` section, in order, and
  nothing else (a section added without its line, or a renamed one, fails here)."""
  text = _markdown("experiments/RESULTS.md")
  topics = [line[3:] for line in text.splitlines() if line.startswith("## ") and line != "## Contents"]
  contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
  links = re.findall(r"^\d+\. \[([^\]]+)\]\((#[^)]+)\)$", contents, re.M)
  assert [title for title, _ in links] == topics
  assert [anchor for _, anchor in links] == [_anchor(t) for t in topics]
  assert _anchor("After a run: export, report, sample, consensus, W&B") == "#after-a-run-export-report-sample-consensus-wb"


def test_the_extraction_finds_the_commands_it_should():
  """The extractor itself: commands in fences, indented blocks and inline spans (wrapped across lines),
  with continuation lines, environment settings and launch_local's `--` are found and read right."""
  found = {(s.where.split(":")[0], " ".join(t)) for s, t in all_commands() if t}
  joined = "\n".join(c for _, c in found)
  assert "bash scripts/run_default.sh" in joined  # README fence
  assert any(c.startswith("python -m noloco_jax.io.data.train_spm --config=configs/c4.py") for _, c in found)  # indented
  assert any(c.startswith("python -m noloco_jax.runtime.launch_local") and " -- " in c for _, c in found)
  assert any(c.startswith(".venv/bin/jupyter execute --inplace") for _, c in found)  # after NOLOCO_SEEDS=0,1
  assert any(c.startswith("python experiments/bench_inner.py") for _, c in found)  # after XLA_FLAGS=...
  assert len([1 for f, _ in found if f == "experiments/RESULTS.md"]) > 30


def test_the_checks_catch_what_they_should():
  """Each kind of mistake the test is for, on commands written here."""
  bad = {
      "python -m noloco_jax.main --config=configs/default.py --workdir=w --config.outer.pairing_pool=4":
          "not a field",
      "python -m noloco_jax.main --config=configs/default.py --config.outer.kind=epidemic --config.outer.rule.fanout=9":
          "does not validate",
      "python experiments/no_such_script.py": "does not exist",
      "python -m noloco_jax.no_such_module": "no such module",
      "python experiments/bench_compression.py --no_such_flag": "defines no flag",
      "python -m noloco_jax.runtime.launch_local --num_processes=2 -- --config=configs/default.py:smoke "
      "--config.outer.nope=1": "not a field",
      "python -m noloco_jax.main --config=configs/nope.py": "does not exist",
      "python -m noloco_jax.runtime.launch_local --num_processes=2 --module=experiments.async_demo -- --nope=1":
          "async_demo.py defines no flag --nope",
      "bash scripts/nope.sh": "does not exist",
      "pip install -e .[plotz]": "no extra",
      "python experiments/bench_outer.py --part=pairing --rounds=6 --config.outer.pairing_pool=4": "not a field of the config",
      "python experiments/bench_ab.py --a.outer.pairing_pool=4": "not a field of the schema",
      "python experiments/bench_ab.py --a.outer.inner_steps=often": "outer.inner_steps",
      "python experiments/bench_ab.py --c.outer.inner_steps=5": "takes no --c.FIELD overrides",
      "python experiments/bench_async.py --config.outer.inner_steps=5": "takes no --config.FIELD overrides",
      "python experiments/ablations/execute_cells.py experiments/ablations/04_compression.ipynb 'No such heading'":
          "no markdown heading",
  }
  for text, expected in bad.items():
    (tokens,) = commands(Snippet("here", text))
    issues = check_command(tokens)
    assert any(expected in i for i in issues), (text, issues)
  good = ["python -m noloco_jax.main --config=configs/default.py:smoke --workdir=runs/x --config.outer.kind=diloco",
          "NOLOCO_SMOKE=1 python experiments/bench_compression.py --hlo",
          "python experiments/bench_ab.py --a.model.attention=einsum --b.model.attention=auto --json",
          "python experiments/bench_inner.py --json --config.num_devices=2",
          "python -m noloco_jax.main --config=configs/default.py --workdir=runs/demo [--config.FIELD=VALUE ...]"]
  for text in good:
    (tokens,) = commands(Snippet("here", text))
    assert check_command(tokens) == [], text
  assert missing_files("README.md") == [] and "noloco_jax/outer/gone.py" in _FILE.findall("see `noloco_jax/outer/gone.py`")
  assert _FILE.findall("(outer/overlap.py sends") == ["outer/overlap.py"]
  assert check_config_mention("--config.outer.pairing_pool=4")
  assert not check_config_mention("--config.outer.pairing=fresh")


@pytest.mark.parametrize("path", ["README.md", "experiments/RESULTS.md"])
def test_the_documents_are_read(path):
  assert snippets(path)


# ---- The pages themselves: tables that render, a front door that fits ----


def broken_tables(path: str) -> list[str]:
  """Table rows that markdown renders as text: a `| ... |` line after a line that is neither blank nor a
  row (a paragraph inside a table ends it, and the rows after it become running text), or a table whose
  second line is not its header's separator."""
  problems, lines = [], _markdown(path).split("\n")
  fenced = False
  for i, line in enumerate(lines):
    if line.lstrip().startswith("```"):
      fenced = not fenced
    is_row = not fenced and line.startswith("|")
    if not is_row:
      continue
    before = lines[i - 1] if i else ""
    if before.strip() and not before.startswith("|"):
      problems.append(f"{path}:{i + 1}: a table row after a line of text (renders as text): {line[:80]}")
    elif not before.strip():  # a table's first line: its separator must follow
      after = lines[i + 1] if i + 1 < len(lines) else ""
      if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+\s*", after):
        problems.append(f"{path}:{i + 1}: a table without its |---| separator line: {line[:80]}")
  return problems


def test_every_table_of_the_readme_and_docs_renders_as_a_table():
  """Issue 34 item 1: a paragraph inside the README's configuration table turned 11 rows into running text."""
  pages = ["README.md"] + [p for p in documents() if p.startswith("docs/")]
  problems = [issue for page in pages for issue in broken_tables(page)]
  assert not problems, "\n" + "\n".join(problems)
  # The check finds the defect it is for.
  assert _check_table_text("| a | b |\n|---|---|\n| 1 | 2 |\ntext\n| 3 | 4 |")
  assert not _check_table_text("| a | b |\n|---|---|\n| 1 | 2 |\n\ntext\n")


def _check_table_text(text: str) -> list[str]:
  import tempfile  # pylint: disable=g-import-not-at-top
  with tempfile.NamedTemporaryFile("w", suffix=".md", dir=REPO, delete=False) as f:
    f.write(text)
  try:
    return broken_tables(os.path.relpath(f.name, REPO))
  finally:
    os.remove(f.name)


def test_the_readme_is_a_front_door():
  """Issue 34 item 1: the README was 725 lines. It fits two screens (what it is, the two commands, a short
  tour, where to read on); the reference material is in docs/, and every page it points to exists."""
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    text = f.read()
  assert len(text.splitlines()) <= 120, len(text.splitlines())
  assert "bash scripts/run_default.sh" in text and "bash scripts/test.sh" in text
  for page in ("configuration", "data", "running", "after_a_run", "scale", "install"):
    assert f"(docs/{page}.md)" in text and os.path.exists(os.path.join(REPO, "docs", f"{page}.md")), page
