"""What every config section shares: a frozen dataclass read from a ConfigDict, and one-line errors.

A section is a frozen dataclass whose fields are the section's config fields, with their defaults
and a comment each; its `check` validates what the section alone can see. `Section.parse` reads a
ConfigDict (or dict, or an instance) into it:

- a field the ConfigDict lacks takes the dataclass's default (a config written before the field
  existed keeps working);
- a field the dataclass lacks is a ConfigError that suggests the nearest field;
- a field typed `X | None` with default None may be left unset (None): the section resolves it when
  it is built (config/outer.py: each kind's paper defaults), and remembers which it resolved
  (`unset_fields`). A config file's ConfigDict keeps those as unset typed placeholders
  (`to_config_dict(for_config_file=True)`), so that "left alone" and "set to the default" stay apart;
- a renamed field (`RENAMED`: old name -> new name, which may be a field of a subsection: the flat
  `compression` of config.outer became `codec.compression`) is read under its old name too, with a
  one-line warning; old and new set to different values is an error (a new field unset, or at the value it
  had as a default before it could be unset (`UNSET`), counts as not set);
- every value is checked against the field's type (bool, int, float, str; an int is accepted and
  converted where a float is expected).

Every failure is a ConfigError whose message is one line naming the field, the value and what is
valid; main.py prints it as `noloco_jax: MESSAGE` and exits with status 2.
"""

import dataclasses
import difflib
import json
import logging
import types
from typing import Any, ClassVar, Mapping

import ml_collections


class ConfigError(ValueError):
  """An invalid config. The message is one line: the field, the value and what would be valid."""


def fail(field: str, value: Any, valid: str):
  """Raises the ConfigError for `config.FIELD=VALUE`, e.g. fail("outer.kind", "x", "one of a | b")."""
  raise ConfigError(f"config.{field}={value!r} is not valid: {valid}.")


def one_of(field: str, value: Any, allowed) -> None:
  if value not in allowed:
    fail(field, value, "one of " + " | ".join(repr(a) if a == "" else str(a) for a in allowed))


def at_least(field: str, value: int, low: int) -> None:
  if value < low:
    fail(field, value, f"an integer ≥ {low}")


def not_a_field(path: str, name: str, known, renamed: Mapping[str, str] | None = None) -> ConfigError:
  """The error for `config.PATH.NAME`, which is no field of `config.PATH` (whose fields are `known`;
  `renamed` maps old names to new ones: a name close to an old one gets the new one suggested)."""
  where = f"config.{path}" if path else "config"
  renamed = renamed or {}
  close = difflib.get_close_matches(name, list(known) + list(renamed), n=1, cutoff=0.6)
  if close:
    return ConfigError(f"{where}.{name} is not a field; did you mean {where}.{renamed.get(close[0], close[0])}?")
  return ConfigError(f"{where}.{name} is not a field; the fields of {where} are {', '.join(sorted(known))}.")


TYPE_WORDS = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}


def typed(field: str, value: Any, kind: type) -> Any:
  """`value` as a `kind`, or a ConfigError. bool is not an int here, an int is a float."""
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    fail(field, value, TYPE_WORDS[kind])
  return value


def base_type(kind) -> tuple[Any, bool]:
  """(the type, whether None is allowed) of a field annotation: `float | None` -> (float, True)."""
  if isinstance(kind, types.UnionType):
    args = [a for a in kind.__args__ if a is not type(None)]
    return args[0], len(args) < len(kind.__args__)
  return kind, False


@dataclasses.dataclass(frozen=True)
class Section:
  """Base of every section. Subclasses set PATH (e.g. "outer"; "" for the top level) and may set
  RENAMED, and override `check`."""

  PATH: ClassVar[str] = ""  # where the section sits: "outer" is config.outer
  RENAMED: ClassVar[Mapping[str, str]] = {}  # old field name -> new field name
  UNSET: ClassVar[Mapping[str, Any]] = {}  # field that may be unset -> the default it had before

  def check(self) -> None:
    """Raises ConfigError on the first invalid field of this section alone (no other section needed)."""

  def unset_fields(self) -> tuple[str, ...]:
    """The fields that were left unset (None) and resolved by the section when it was built."""
    return ()

  @classmethod
  def field_path(cls, name: str) -> str:
    return f"{cls.PATH}.{name}" if cls.PATH else name

  @classmethod
  def parse(cls, node) -> "Section":
    """The checked section from a ConfigDict, a dict or an instance (see the module docstring)."""
    if isinstance(node, cls):
      return node
    if isinstance(node, Section):
      node = dataclasses.asdict(node)
    if not hasattr(node, "items"):
      fail(cls.PATH or "<top>", node, "a section (a ConfigDict of fields)")
    items = dict(node.items())
    fields = {f.name: f for f in dataclasses.fields(cls)}
    cls._map_renamed(items)
    values = {}
    for name, value in items.items():
      if name not in fields:
        raise not_a_field(cls.PATH, name, list(fields), cls.RENAMED)
      kind, optional = base_type(fields[name].type)
      if isinstance(kind, type) and issubclass(kind, Section):
        values[name] = kind.parse(value)
      elif value is None and optional:
        values[name] = None  # unset: resolved by the section (see unset_fields)
      else:
        values[name] = typed(cls.field_path(name), value, kind)
    section = cls(**values)
    section.check()
    return section

  @classmethod
  def _map_renamed(cls, items: dict) -> None:
    """Reads each old name into its new field; a new name "codec.compression" is a field of a subsection
    (items["codec"], copied into a dict here)."""
    for old, new in cls.RENAMED.items():
      if old not in items:
        continue
      old_value = items.pop(old)
      if old_value is None:  # the placeholder the config files keep for the old name: not set
        continue
      target, section = items, cls
      *path, name = new.split(".")
      for part in path:
        target[part] = dict(target[part].items()) if target.get(part) is not None else {}
        target, section = target[part], section.field_type(part)
      now = target.get(name)
      if now is not None and now != section.UNSET.get(name, getattr(section, name, None)) and now != old_value:
        raise ConfigError(f"config.{cls.field_path(old)}={old_value!r} and config.{cls.field_path(new)}="
                          f"{now!r} are both set; {old} is the old name of {new}: set only {new}.")
      logging.warning("config.%s is deprecated: use config.%s (same meaning); taking %s=%r.",
                      cls.field_path(old), cls.field_path(new), new, old_value)
      target[name] = old_value

  @classmethod
  def field_type(cls, name: str):
    """The type of field `name` (a dotted name reaches into subsections)."""
    section, *rest = name.split(".", 1)
    kind = base_type({f.name: f for f in dataclasses.fields(cls)}[section].type)[0]
    return kind.field_type(rest[0]) if rest else kind


  def to_config_dict(self, for_config_file: bool = False) -> ml_collections.ConfigDict:
    """The section as a ConfigDict (what the trainer reads: every field resolved). `for_config_file`
    (the base of a config file) keeps the unset fields unset and adds each old name of a renamed field,
    both as typed placeholders: `--config.outer.lr=...` then parses, and a field left alone stays
    distinguishable from one set to its default."""
    out = ml_collections.ConfigDict()
    kinds = {}
    unset = self.unset_fields() if for_config_file else ()
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      kinds[f.name] = base_type(f.type)[0]
      if isinstance(value, Section):
        out[f.name] = value.to_config_dict(for_config_file)
      elif f.name in unset:
        out[f.name] = ml_collections.config_dict.placeholder(kinds[f.name])
      else:
        out[f.name] = value
    if for_config_file:
      for old, new in self.RENAMED.items():
        out[old] = ml_collections.config_dict.placeholder(self.field_type(new))
    return out

  def to_dict(self) -> dict[str, Any]:
    """The section as nested plain dicts (JSON-able), every field under its current name."""
    return {f.name: (getattr(self, f.name).to_dict() if isinstance(getattr(self, f.name), Section)
                     else getattr(self, f.name)) for f in dataclasses.fields(self)}

  def to_json(self, **kwargs) -> str:
    """`json.dumps(self.to_dict(), **kwargs)`: what config.json, checkpoint metadata and the start-up
    consistency check hold (the same text ml_collections' to_json_best_effort gave)."""
    return json.dumps(self.to_dict(), **kwargs)

  def replace(self, **changes) -> "Section":
    """A checked copy with `changes` (a frozen section is never modified in place)."""
    section = dataclasses.replace(self, **changes)
    section.check()
    return section

  # Read a section like a ConfigDict: section["lr"], section.get("lr").
  def __getitem__(self, name: str):
    return getattr(self, name)

  def get(self, name: str, default=None):
    return getattr(self, name, default)
