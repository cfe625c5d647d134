"""Attacks on kvgov's doors, one test per attack: each fails while the attack works
(``docs/threat-model.md`` lists the doors)."""
