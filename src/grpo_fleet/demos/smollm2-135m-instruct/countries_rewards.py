"""Rewards for the long-answer recipe (long-answers.toml beside this file): list N different countries.

A reply is long by nature (10 to 41 lines of a few tokens each, up to about 200
tokens) and every line can earn credit, so a group's replies spread in both
length and reward: some stop after two lines, some repeat "China" until the
budget runs out, some list twenty real countries. SmolLM2-135M-Instruct at
temperature 0.7 held reward variance in every group probed, which is what GRPO
needs; reasoning tasks give a model this small no signal at all (see the
docs/getting-started.md, "Long answers").

A country counts once under any of its common names ("USA", "United States of
America"), with or without a list marker ("3. Peru", "- Peru").
Every actor needs the same file (`--reward-module PATH`); the demo passes it for you.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from grpo_fleet.tasks import register_reward

# The 193 UN members, two observers and Taiwan; "|" separates other names of the same country.
_COUNTRIES = """Afghanistan; Albania; Algeria; Andorra; Angola; Antigua and Barbuda; Argentina; Armenia; Australia;
Austria; Azerbaijan; Bahamas|The Bahamas; Bahrain; Bangladesh; Barbados; Belarus; Belgium; Belize; Benin; Bhutan;
Bolivia; Bosnia and Herzegovina|Bosnia; Botswana; Brazil; Brunei; Bulgaria; Burkina Faso; Burundi;
Cabo Verde|Cape Verde; Cambodia; Cameroon; Canada; Central African Republic; Chad; Chile; China; Colombia; Comoros;
Congo|Republic of the Congo; Democratic Republic of the Congo|DR Congo|DRC; Costa Rica; Cote d'Ivoire|Ivory Coast;
Croatia; Cuba; Cyprus; Czech Republic|Czechia; Denmark; Djibouti; Dominica; Dominican Republic; Ecuador; Egypt;
El Salvador; Equatorial Guinea; Eritrea; Estonia; Eswatini|Swaziland; Ethiopia; Fiji; Finland; France; Gabon;
Gambia|The Gambia; Georgia; Germany; Ghana; Greece; Grenada; Guatemala; Guinea; Guinea-Bissau; Guyana; Haiti;
Honduras; Hungary; Iceland; India; Indonesia; Iran; Iraq; Ireland; Israel; Italy; Jamaica; Japan; Jordan;
Kazakhstan; Kenya; Kiribati; Kuwait; Kyrgyzstan; Laos; Latvia; Lebanon; Lesotho; Liberia; Libya; Liechtenstein;
Lithuania; Luxembourg; Madagascar; Malawi; Malaysia; Maldives; Mali; Malta; Marshall Islands; Mauritania;
Mauritius; Mexico; Micronesia; Moldova; Monaco; Mongolia; Montenegro; Morocco; Mozambique; Myanmar|Burma; Namibia;
Nauru; Nepal; Netherlands|The Netherlands|Holland; New Zealand; Nicaragua; Niger; Nigeria; North Korea;
North Macedonia|Macedonia; Norway; Oman; Pakistan; Palau; Palestine; Panama; Papua New Guinea; Paraguay; Peru;
Philippines|The Philippines; Poland; Portugal; Qatar; Romania; Russia|Russian Federation; Rwanda;
Saint Kitts and Nevis; Saint Lucia; Saint Vincent and the Grenadines; Samoa; San Marino; Sao Tome and Principe;
Saudi Arabia; Senegal; Serbia; Seychelles; Sierra Leone; Singapore; Slovakia; Slovenia; Solomon Islands; Somalia;
South Africa; South Korea|Korea; South Sudan; Spain; Sri Lanka; Sudan; Suriname; Sweden; Switzerland; Syria; Taiwan;
Tajikistan; Tanzania; Thailand; Timor-Leste|East Timor; Togo; Tonga; Trinidad and Tobago; Tunisia; Turkey|Turkiye;
Turkmenistan; Tuvalu; Uganda; Ukraine; United Arab Emirates|UAE; United Kingdom|UK|Great Britain|Britain;
United States|United States of America|USA|US|America; Uruguay; Uzbekistan; Vanuatu; Vatican City|Vatican|Holy See;
Venezuela; Vietnam|Viet Nam; Yemen; Zambia; Zimbabwe"""

# A list marker a line may start with: "3.", "3)", "-", "*" or a bullet.
_MARKER = re.compile(r"^\s*(?:\d+\s*[.):]|[-*\u2022])\s*")


def _plain(text: str) -> str:
    """Lower case, accents dropped, anything but letters as one space: "Côte d'Ivoire." -> "cote d ivoire"."""
    decomposed = unicodedata.normalize("NFKD", text)
    letters = "".join(ch for ch in decomposed if not unicodedata.combining(ch)).lower()
    return re.sub(r"[^a-z]+", " ", letters).strip()


def _canonical_names() -> dict[str, str]:
    names: dict[str, str] = {}
    for entry in _COUNTRIES.replace("\n", " ").split(";"):
        spellings = [_plain(name) for name in entry.split("|") if name.strip()]
        names.update({spelling: spellings[0] for spelling in spellings})
    return names


_CANONICAL = _canonical_names()


def _lines(completion: str) -> list[str]:
    """The reply's non-empty lines, list markers stripped, in plain form."""
    return [plain for plain in (_plain(_MARKER.sub("", line)) for line in completion.splitlines()) if plain]


def _wanted(answer: str) -> int:
    return max(1, int(answer))


@register_reward
def countries_listed(completion: str, prompt: str, *, answer: str, **columns: Any) -> float:
    """Different real countries among the reply's first N lines, over the N asked for: partial credit per line.

    Repeats, prose and lines past the N-th earn nothing, so a reply gains by naming more different countries and
    nothing by running on. (A separate reward for a clean list taught the model a short one: three clean lines
    scored more than twenty with two repeats, and replies fell from 139 tokens to 22 in three steps.)
    """
    wanted = _wanted(answer)
    found = {_CANONICAL[line] for line in _lines(completion)[:wanted] if line in _CANONICAL}
    return len(found) / wanted
