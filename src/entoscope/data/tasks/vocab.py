"""Word lists used by the built-in tasks (and by the demo model's training corpus).

Every word here is meant to be written after a space (" Mary", " Paris", " apple"); the bundled demo
tokenizer was trained so that each of them, with its leading space, is one token. Under another
tokenizer the task generators keep only the words that are one token there.
"""

from __future__ import annotations

# First names for IOI (Wang et al. 2022 use a similar list of common English names).
NAMES: tuple[str, ...] = (
    "Mary", "John", "Tom", "James", "Dan", "Sid", "Martin", "Amy", "Lisa", "Anna",
    "Kate", "Paul", "Mark", "Alex", "Sam", "Ben", "Max", "Luke", "Jack", "Ryan",
    "Adam", "Eric", "Emma", "Sarah", "Laura", "Rose", "Grace", "Jane", "Carl", "Dave",
    "Steve", "Michael", "David", "Daniel", "Andrew", "Robert", "Peter", "Helen", "Lucy", "Susan",
)

# Places and objects of the IOI templates ("went to the {place}", "gave a {object} to").
PLACES: tuple[str, ...] = (
    "store", "garden", "restaurant", "school", "hospital", "office", "station", "house",
    "park", "beach", "market", "library", "church", "museum", "bank",
)
# All start with a consonant sound: the templates say "a {object}".
OBJECTS: tuple[str, ...] = (
    "drink", "ring", "bone", "basketball", "computer", "necklace", "snack", "book",
    "ball", "gift", "letter", "flower", "bag", "hat", "ticket", "card", "cake", "cup",
)

# (country, capital): single words on both sides.
COUNTRIES: tuple[tuple[str, str], ...] = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"),
    ("Greece", "Athens"), ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Peru", "Lima"),
    ("Chile", "Santiago"), ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
    ("Hungary", "Budapest"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Turkey", "Ankara"),
    ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("Cuba", "Havana"), ("Ghana", "Accra"), ("Morocco", "Rabat"), ("Belgium", "Brussels"),
)

# Nouns of the greater-than sentences ("The {noun} lasted from the year 1732 to the year 17").
GT_NOUNS: tuple[str, ...] = (
    "war", "expedition", "project", "voyage", "reign", "festival", "drought", "siege",
    "campaign", "journey", "famine", "dynasty",
)
# First two digits of the years ("the year 17"); Hanna et al. 2023 use 11..17 as well.
CENTURIES: tuple[int, ...] = (11, 12, 13, 14, 15, 16, 17)

# Two-digit numbers. The demo tokenizer makes " 00".." 99" (with a space) and "00".."99" (the second
# half of a year: " 1732" is [" 17", "32"]) one token each.
TWO_DIGITS: tuple[str, ...] = tuple(f"{i:02d}" for i in range(100))

# Common words for the induction task's random sequences (disjoint from the lists above).
INDUCTION_WORDS: tuple[str, ...] = (
    "apple", "river", "green", "table", "cloud", "stone", "music", "light", "water", "paper",
    "window", "chair", "bread", "horse", "train", "night", "summer", "winter", "mountain", "forest",
    "city", "road", "door", "glass", "money", "dog", "cat", "bird", "fish", "tree",
    "sun", "moon", "star", "sky", "sea", "lake", "hill", "field", "farm", "town",
    "king", "queen", "child", "mother", "father", "friend", "teacher", "doctor", "student", "farmer",
    "red", "blue", "yellow", "black", "white", "small", "large", "old", "new", "happy",
    "quick", "slow", "cold", "warm", "dark", "bright", "soft", "hard", "loud", "quiet",
    "run", "walk", "jump", "sing", "read", "write", "eat", "cook", "sleep", "swim",
    "open", "close", "push", "pull", "build", "break", "find", "lose", "keep", "take",
    "morning", "evening", "week", "year", "month", "day", "hour", "minute", "time", "life",
    "word", "name", "story", "song", "game", "picture", "color", "shape", "number", "voice",
    "box", "key", "lamp", "clock", "phone", "shoe", "shirt", "coat", "bed", "wall",
    "floor", "roof", "kitchen", "room", "car", "boat", "plane", "bike", "bus", "ship",
    "gold", "silver", "iron", "wood", "sand", "snow", "rain", "wind", "fire", "ice",
    "milk", "tea", "rice", "salt", "sugar", "egg", "cheese", "soup", "fruit", "corn",
)
