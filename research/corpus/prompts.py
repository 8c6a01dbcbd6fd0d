"""Self-distillation prompts: chat instructions built from topic x task-kind templates, and seeds for base models.

    rows = instructions()                      # [Instruction(text, topic, kind), ...], fixed order, ~17K
    check_heldout(rows)                        # refuses overlap with the evaluation's held-out chat instructions
    SEEDS                                      # short text openings for a base (non-chat) teacher

The topics are disjoint from the topics of headscope/evaluate/data/fidelity/chat_heldout.jsonl (cooking, travel,
history, physics, biology, mathematics, programming, health, personal finance, literature, geography, music,
language, everyday life, work and email, environment), so the evaluation's chat instructions stay unseen in kind of
content as well as in text; ``check_heldout`` reads that file and refuses any shared instruction or topic.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

CHAT_HELDOUT = Path(__file__).resolve().parents[2] / "headscope" / "evaluate" / "data" / "fidelity" / \
    "chat_heldout.jsonl"


@dataclass(frozen=True)
class Instruction:
    text: str
    topic: str
    kind: str


# topic -> things to ask about (8 each)
TOPICS: dict[str, tuple[str, ...]] = {
    "astronomy": ("black holes", "the phases of the Moon", "comets", "neutron stars", "the life cycle of a star",
                  "solar eclipses", "the rings of Saturn", "exoplanets"),
    "chemistry": ("chemical bonds", "acids and bases", "catalysts", "the periodic table", "oxidation", "polymers",
                  "isotopes", "crystals"),
    "geology": ("volcanoes", "earthquakes", "plate tectonics", "sedimentary rock", "fossils", "glaciers", "caves",
                "minerals"),
    "weather": ("thunderstorms", "hurricanes", "fog", "weather fronts", "snowflakes", "rainbows", "air pressure",
                "weather forecasts"),
    "architecture": ("Gothic cathedrals", "arches", "skyscrapers", "domes", "bridges", "brick houses",
                     "modernist buildings", "castles"),
    "visual arts": ("oil painting", "watercolour", "perspective drawing", "sculpture", "mosaics", "printmaking",
                    "portraits", "colour theory"),
    "film": ("silent films", "animation", "film editing", "documentaries", "special effects", "film scores",
             "camera angles", "screenwriting"),
    "theater": ("stage lighting", "improvisation", "costume design", "puppet theatre", "opera", "rehearsals",
                "stage sets", "comedy"),
    "photography": ("shutter speed", "aperture", "portrait photography", "film cameras", "composition",
                    "night photography", "lenses", "photo editing"),
    "philosophy": ("free will", "the trolley problem", "Socrates", "scepticism", "the meaning of happiness",
                   "logic", "personal identity", "Stoicism"),
    "law": ("contracts", "copyright", "juries", "the presumption of innocence", "patents", "tenancy agreements",
            "small-claims courts", "witnesses"),
    "civics": ("elections", "parliaments", "local councils", "constitutions", "the separation of powers",
               "referendums", "public libraries", "taxes"),
    "economics": ("inflation", "supply and demand", "interest rates set by central banks", "trade tariffs",
                  "unemployment", "monopolies", "economic growth", "scarcity"),
    "sports": ("marathon running", "football tactics", "tennis serves", "swimming strokes", "the Olympic Games",
               "cycling races", "rock climbing", "team training"),
    "board games": ("chess openings", "the game of Go", "backgammon", "crossword puzzles", "card games", "dominoes",
                    "strategy games", "sudoku"),
    "crafts": ("woodworking", "knitting", "pottery", "bookbinding", "embroidery", "origami", "candle making",
               "leatherwork"),
    "fashion": ("cotton and wool", "tailoring", "shoes", "uniforms", "dyes", "hats", "vintage clothing",
                "sewing patterns"),
    "mythology": ("Greek myths", "Norse gods", "dragons in folklore", "trickster figures", "flood myths",
                  "heroes' journeys", "fairy folk", "origin stories"),
    "engineering": ("gears", "levers", "concrete", "steam engines", "dams", "robots", "3D printing", "tunnels"),
    "electronics": ("resistors", "transistors", "batteries", "circuit boards", "LEDs", "soldering", "radio waves",
                    "microcontrollers"),
    "computer hardware": ("CPUs", "memory chips", "hard drives", "graphics cards", "keyboards", "cooling fans",
                          "computer displays", "power supplies"),
    "space exploration": ("the Apollo missions", "space stations", "Mars rovers", "rockets", "satellites",
                          "spacesuits", "space telescopes", "astronaut training"),
    "psychology": ("memory", "habits", "motivation", "attention", "dreams", "emotions", "learning new skills",
                   "decision making"),
    "sociology": ("cities", "families", "traditions", "social media", "communities", "migration", "festivals",
                  "volunteering"),
    "education": ("homework", "exams", "online courses", "classroom discussions", "note taking", "reading aloud",
                  "group projects", "lifelong learning"),
    "business": ("starting a small shop", "advertising", "customer service", "pricing", "brand names", "inventory",
                 "market research", "negotiation"),
}

# kind -> templates; {thing}, {other} (another thing of the topic), {topic}, {passage}
KINDS: dict[str, tuple[str, ...]] = {
    "explain": ("Explain {thing} in simple terms.", "Why does {thing} matter in {topic}?",
                "How does {thing} work? Explain it to a curious twelve-year-old."),
    "how_to": ("How would a beginner get started with {thing}?", "Describe the steps to learn about {thing}."),
    "list": ("List five interesting facts about {thing}.", "Name three common misconceptions about {thing}."),
    "compare": ("Compare {thing} and {other}.", "What do {thing} and {other} have in common, and how do they "
                "differ?"),
    "short_answer": ("In one sentence, what is {thing}?", "What is the most important thing to know about {thing}?"),
    "creative": ("Write a short poem about {thing}.", "Write a one-paragraph story in which {thing} plays a part.",
                 "Write a dialogue between two friends who disagree about {thing}."),
    "summarize": ("Summarize in one sentence: {passage}", "Give the main point of this text: {passage}"),
    "brainstorm": ("Suggest three questions a student could research about {thing}.",
                   "Give four ideas for a school exhibition on {thing}."),
    "advice": ("I want to understand {thing} better. Where should I start?",
               "What mistakes do people often make when they first learn about {thing}?"),
    "classify": ("Is {thing} mostly a topic of {topic} or of something else? Explain your answer.",),
    "rewrite": ("Rewrite this sentence to be clearer: '{passage}'",
                "Make this text sound more formal: '{passage}'"),
    "translate": ("Translate into Spanish: 'I read a book about {thing} yesterday.'",
                  "Translate into German: 'My friend is very interested in {thing}.'"),
}

# how the request is to be answered; crossed with the templates of the kinds in STYLED
STYLES = ("", " Keep the answer short.", " Use an everyday analogy.", " Answer for an expert reader.",
          " Use a numbered list.", " Answer in about one hundred words.")
STYLED = ("explain", "how_to", "compare", "advice", "brainstorm")

PASSAGES = ("{Thing} is a subject that many people find confusing at first, but the basic ideas are simple once "
            "someone explains them with a good example.",
            "People have studied {thing} for a long time, and even today specialists in {topic} argue about some "
            "of the details.")

# a base (non-chat) teacher continues these openings (and its BOS token alone)
SEEDS = ("The", "In the beginning", "Chapter 1\n\n", "Once upon a time", "It was", "def ", "import ",
         "#include <", "The following", "Dear", "Q: ", "Introduction\n\n", "I think", "When", "A", "In 19",
         "This document", "Abstract\n\n", "\"", "Yesterday")


def instructions() -> list[Instruction]:
    """Every training instruction: topics x things x kinds x templates (x styles), in a fixed order, distinct."""
    out: list[Instruction] = []
    seen: set[str] = set()
    for topic, things in TOPICS.items():
        for i, thing in enumerate(things):
            other = things[(i + 3) % len(things)]
            for kind, templates in KINDS.items():
                for t in templates:
                    passage = PASSAGES[len(out) % len(PASSAGES)]
                    passage = passage.replace("{Thing}", thing[:1].upper() + thing[1:]).format(thing=thing,
                                                                                            topic=topic)
                    text = t.format(thing=thing, other=other, topic=topic, passage=passage)
                    styles = STYLES if kind in STYLED else ("",)
                    for style in styles:
                        full = text + style
                        if normalize(full) not in seen:
                            seen.add(normalize(full))
                            out.append(Instruction(full, topic, kind))
    return out


def normalize(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


def prompt_set_id(rows: list[Instruction]) -> str:
    """16 hex digits of the instruction set (text, topic, kind, in order)."""
    payload = json.dumps([[r.text, r.topic, r.kind] for r in rows])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def heldout_chat(path: Path = CHAT_HELDOUT) -> list[dict]:
    """The evaluation's held-out chat instructions ([] while the file does not exist)."""
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


class HeldOutOverlapError(ValueError):
    """Training instructions that share text or a topic with the held-out chat instructions."""


def check_heldout(rows: list[Instruction], path: Path = CHAT_HELDOUT) -> None:
    """Refuse training instructions equal to (or containing, or contained in) a held-out chat instruction, after
    lowercasing and dropping punctuation, and any whose topic is a held-out topic."""
    held = heldout_chat(path)
    if not held:
        return
    topics = {h.get("topic", "").lower() for h in held} - {""}
    bad_topics = sorted({r.topic for r in rows if r.topic.lower() in topics})
    if bad_topics:
        raise HeldOutOverlapError(f"training topics {bad_topics} are held-out chat topics ({path}); remove them "
                                  "from research.corpus.prompts.TOPICS")
    held_text = [normalize(h["instruction"]) for h in held]
    held_set = set(held_text)
    for r in rows:
        n = normalize(r.text)
        if n in held_set or any(len(h) > 20 and (h in n or n in h) for h in held_text):
            raise HeldOutOverlapError(f"training instruction {r.text!r} overlaps a held-out chat instruction "
                                      f"({path}); change its template in research.corpus.prompts")
