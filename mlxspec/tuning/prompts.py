"""The built-in prompts acceptance is measured on: one per kind of work speculation meets
(editing code the prompt holds, writing new code, prose), since each drafter's acceptance
differs a lot between them."""

_SETTINGS_MODULE = '''import json
from pathlib import Path


def load_settings(path):
    """Read the settings file, or return the defaults."""
    path = Path(path)
    if not path.exists():
        return {"theme": "light", "font_size": 12, "autosave": True}
    with open(path) as f:
        return json.load(f)


def save_settings(path, settings):
    with open(path, "w") as f:
        json.dump(settings, f, indent=2)


def update_setting(path, key, value):
    settings = load_settings(path)
    settings[key] = value
    save_settings(path, settings)
    return settings
'''

PROMPTS = {
    "code edit": ("Here is a Python file:\n\n```python\n" + _SETTINGS_MODULE + "```\n\n"
                  "Rename the function update_setting to set_setting everywhere and give the "
                  "default font_size the value 14. Reply with the whole updated file only."),
    "code completion": ("Complete this Python module: a function that parses a CSV line with "
                        "quoted fields, with a docstring and tests.\n\n```python\n"
                        "def parse_csv_line(line: str, sep: str = \",\") -> list[str]:\n"),
    "prose": ("Write a short essay about the history of lighthouses, how they work, and why "
              "some are still kept today."),
}
