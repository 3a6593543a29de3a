"""What every config section shares: a frozen dataclass read from a ConfigDict, and one-line errors.

A section is a frozen dataclass whose fields are the section's config fields, with their defaults
and a comment each; its `check` validates what the section alone can see. `Section.parse` reads a
ConfigDict (or dict, or an instance) into it:

- a field the ConfigDict lacks takes the dataclass's default (a config written before the field
  existed keeps working);
- a field the dataclass lacks is a ConfigError that suggests the nearest field;
- a renamed field (`RENAMED`: old name -> new name) is read under its old name too, with a one-line
  warning; old and new set to different values is an error (a new field still at its default
  counts as not set: a ConfigDict cannot tell "left alone" from "set to the default");
- every value is checked against the field's type (bool, int, float, str; an int is accepted and
  converted where a float is expected).

Every failure is a ConfigError whose message is one line naming the field, the value and what is
valid; main.py prints it as `noloco_jax: MESSAGE` and exits with status 2.
"""

import dataclasses
import difflib
import json
import logging
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


@dataclasses.dataclass(frozen=True)
class Section:
  """Base of every section. Subclasses set PATH (e.g. "outer"; "" for the top level) and may set
  RENAMED, and override `check`."""

  PATH: ClassVar[str] = ""  # where the section sits: "outer" is config.outer
  RENAMED: ClassVar[Mapping[str, str]] = {}  # old field name -> new field name

  def check(self) -> None:
    """Raises ConfigError on the first invalid field of this section alone (no other section needed)."""

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
    cls._map_renamed(items, fields)
    values = {}
    for name, value in items.items():
      if name not in fields:
        raise not_a_field(cls.PATH, name, list(fields), cls.RENAMED)
      kind = fields[name].type
      if isinstance(kind, type) and issubclass(kind, Section):
        values[name] = kind.parse(value)
      else:
        values[name] = typed(cls.field_path(name), value, kind)
    section = cls(**values)
    section.check()
    return section

  @classmethod
  def _map_renamed(cls, items: dict, fields: dict) -> None:
    for old, new in cls.RENAMED.items():
      if old not in items:
        continue
      old_value = items.pop(old)
      if old_value is None:  # the placeholder the config files keep for the old name: not set
        continue
      default = fields[new].default
      if new in items and items[new] != default and items[new] != old_value:
        raise ConfigError(f"config.{cls.field_path(old)}={old_value!r} and config.{cls.field_path(new)}="
                          f"{items[new]!r} are both set; {old} is the old name of {new}: set only {new}.")
      logging.warning("config.%s is deprecated: use config.%s (same meaning); taking %s=%r.",
                      cls.field_path(old), cls.field_path(new), new, old_value)
      items[new] = old_value

  def to_config_dict(self, renamed_placeholders: bool = False) -> ml_collections.ConfigDict:
    """The section as a ConfigDict (what the trainer reads). `renamed_placeholders` adds each old name
    as an unset typed placeholder, so that a config file built from it accepts `--config.outer.lr=...`."""
    out = ml_collections.ConfigDict()
    types = {}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      out[f.name] = value.to_config_dict(renamed_placeholders) if isinstance(value, Section) else value
      types[f.name] = f.type
    if renamed_placeholders:
      for old, new in self.RENAMED.items():
        out[old] = ml_collections.config_dict.placeholder(types[new])
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
