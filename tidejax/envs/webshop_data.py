"""Vocabulary for the generated WebShop-style catalogue: product types and their pools.

Written for tidejax from the WebShop paper's description of its data (Amazon products
in five departments, each with a category path, title, attributes mined from the
text, options such as size and colour, and a price); no WebShop data is used. Within a
fuzzy-matched pool (attributes; options other than size and length, which the reward
matches exactly) no two values fuzzy-match each other (rapidfuzz token_set_ratio <= 85,
checked in the tests) so that fuzzy reward matching stays meaningful.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ProductType:
    phrase: str  # what a shopper calls it; the product's search query in the catalogue
    title_noun: str  # how titles name it
    category: tuple[str, ...]
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]
    price: tuple[float, float]
    descriptors: tuple[str, ...]
    plural: bool = False


# fmt: off
APPAREL_SIZES = ("x-small", "small", "medium", "large", "x-large", "xx-large", "3x-large")
SHOE_SIZES = ("6", "6.5", "7", "7.5", "8", "8.5", "9", "9.5", "10", "10.5", "11", "12")
COLORS = (
    "black", "white", "navy blue", "heather grey", "red", "olive green", "burgundy", "sky blue",
    "pink", "khaki", "charcoal", "mustard yellow",
)
HAIR_COLORS = (
    "natural black", "jet black", "dark brown", "chestnut", "honey blonde", "platinum blonde",
    "auburn", "silver grey",
)
HAIR_LENGTHS = ("12 inch", "14 inch", "16 inch", "18 inch", "20 inch", "22 inch")
LIQUID_SIZES = (
    "8 fl oz (pack of 1)", "12 fl oz (pack of 1)", "16.9 fl oz (pack of 1)",
    "33.8 fl oz (pack of 1)", "8 fl oz (pack of 2)",
)
SCENTS = ("lavender", "coconut", "unscented", "citrus", "rose", "eucalyptus mint", "vanilla")
SKIN_SIZES = ("0.5 fl oz", "1 fl oz", "1.7 fl oz", "2.5 fl oz", "3.4 fl oz")
FLAVORS = (
    "chocolate", "peanut butter", "sea salt", "barbecue", "vanilla", "original", "honey",
    "cookies and cream", "mixed berry", "caramel", "cinnamon", "jalapeno",
)
DRINK_FLAVORS = (
    "original", "peppermint", "jasmine", "french vanilla", "hazelnut", "lemon", "mango",
    "dark roast", "medium roast", "earl grey",
)
FOOD_SIZES = (
    "12 count (pack of 1)", "24 count (pack of 1)", "6 ounce (pack of 4)", "1 pound (pack of 1)",
    "2 pound (pack of 1)", "pack of 12",
)
WOOD_COLORS = ("black", "white", "walnut", "oak", "grey", "espresso", "natural", "rustic brown")
FURNITURE_SIZES = ("small", "medium", "large", "extra large")
SHELF_SIZES = ("3-tier", "4-tier", "5-tier", "6-tier")
DRINKWARE_SIZES = ("12 oz", "14 oz", "16 oz", "20 oz", "24 oz", "32 oz", "40 oz")
PAN_SIZES = ("8 inch", "10 inch", "12 inch")
PHONE_MODELS = ("iphone 13", "iphone 14", "iphone 15", "galaxy s23", "galaxy s24", "pixel 8")
CABLE_LENGTHS = ("3 ft", "6 ft", "10 ft")
APPAREL_ATTRS = (
    "machine wash", "cotton spandex", "slim fit", "relaxed fit", "long sleeve", "short sleeve",
    "quick drying", "moisture wicking", "button closure", "elastic waistband", "hand wash only",
    "tumble dry", "polyester blend", "classic fit", "wrinkle resistant",
)
SHOE_ATTRS = (
    "non slip", "rubber sole", "arch support", "memory foam", "lace up", "water resistant",
    "lightweight", "breathable mesh", "pull on", "ankle strap", "cushioned insole", "wide width",
)
HAIR_ATTRS = (
    "natural looking", "long lasting", "sulfate free", "paraben free", "cruelty free",
    "heat resistant", "damaged hair", "dry scalp", "easy to use", "high quality", "argan oil",
    "hair growth", "color safe", "human hair", "clip in",
)
SKIN_ATTRS = (
    "sensitive skin", "fragrance free", "hyaluronic acid", "vitamin c", "oil free", "non greasy",
    "dermatologist tested", "cruelty free", "anti aging", "dry skin", "paraben free", "fine lines",
    "dark circles", "spf 50", "natural ingredients",
)
FOOD_ATTRS = (
    "gluten free", "non gmo", "low sugar", "keto friendly", "high protein", "low carb",
    "usda organic", "individually wrapped", "plant based", "kosher certified", "low calorie",
    "dairy free", "whole grain", "no artificial flavors",
)
DRINK_ATTRS = (
    "usda organic", "non gmo", "caffeine free", "zero sugar", "fair trade", "kosher certified",
    "low calorie", "natural flavors", "gluten free", "single origin", "electrolytes",
)
FURNITURE_ATTRS = (
    "easy assembly", "solid wood", "storage space", "metal frame", "living room", "high back",
    "lumbar support", "height adjustable", "space saving", "mid century", "engineered wood",
    "faux leather", "anti tip", "home office", "weight capacity",
)
KITCHEN_ATTRS = (
    "dishwasher safe", "bpa free", "stainless steel", "non stick", "leak proof", "microwave safe",
    "easy clean", "heat resistant", "double wall", "oven safe", "vacuum insulated", "food grade",
    "ceramic coating", "lead free", "freezer safe",
)
MOBILE_ATTRS = (
    "fast charging", "wireless charging", "shockproof", "tempered glass", "easy install",
    "high speed", "usb type c", "lightweight", "slim design", "scratch resistant", "bubble free",
    "drop protection",
)
AUDIO_ATTRS = (
    "noise cancelling", "water resistant", "long battery life", "high definition", "hands free",
    "bluetooth 5.3", "built in microphone", "lightweight", "deep bass", "touch control",
    "fast charging", "stereo sound",
)
# fmt: on

# Attributes no product has together (a shirt is not both long and short sleeved).
EXCLUSIVE_ATTRS = (
    frozenset({"long sleeve", "short sleeve"}),
    frozenset({"slim fit", "relaxed fit", "classic fit"}),
    frozenset({"machine wash", "hand wash only"}),
    frozenset({"solid wood", "engineered wood"}),
    frozenset({"dry skin", "oil free"}),
)

_MEN = ("clothing, shoes & jewelry", "men", "clothing")
_WOMEN = ("clothing, shoes & jewelry", "women", "clothing")
_SHOES = ("clothing, shoes & jewelry", "shoes")
_HAIR = ("beauty & personal care", "hair care")
_SKIN = ("beauty & personal care", "skin care")
_SNACKS = ("grocery & gourmet food", "snacks")
_DRINKS = ("grocery & gourmet food", "beverages")
_FURNITURE = ("home & kitchen", "furniture")
_KITCHEN = ("home & kitchen", "kitchen & dining")
_ELECTRONICS = ("electronics", "accessories")

_APPAREL_OPTS = (("size", APPAREL_SIZES), ("color", COLORS))
_SHOE_OPTS = (("size", SHOE_SIZES), ("color", COLORS))
_WEAR = ("Casual", "Classic", "Premium", "Everyday", "Athletic", "Vintage")
_BEAUTY = ("Professional", "Salon", "Natural", "Daily", "Luxury", "Gentle")
_FOOD = ("Gourmet", "Classic", "Artisan", "Family Size", "Snack", "Premium")
_HOME = ("Modern", "Rustic", "Industrial", "Compact", "Classic", "Farmhouse")
_GEAR = ("Portable", "Premium", "Ultra", "Pro", "Compact", "Heavy Duty")


def _t(phrase, noun, category, attrs, options, price, descriptors, plural=False):
    return ProductType(phrase, noun, category, attrs, options, price, descriptors, plural)


# fmt: off
PRODUCT_TYPES: tuple[ProductType, ...] = (
    _t("men's t-shirt", "Men's T-Shirt", _MEN + ("shirts",), APPAREL_ATTRS, _APPAREL_OPTS, (9, 35),
       _WEAR),
    _t("men's polo shirt", "Men's Polo Shirt", _MEN + ("shirts",), APPAREL_ATTRS, _APPAREL_OPTS,
       (15, 55), _WEAR),
    _t("men's hoodie", "Men's Hoodie", _MEN + ("hoodies",), APPAREL_ATTRS, _APPAREL_OPTS, (20, 70),
       _WEAR),
    _t("men's jeans", "Men's Jeans", _MEN + ("pants",), APPAREL_ATTRS, _APPAREL_OPTS, (25, 90),
       _WEAR, plural=True),
    _t("men's cargo shorts", "Men's Cargo Shorts", _MEN + ("shorts",), APPAREL_ATTRS, _APPAREL_OPTS,
       (15, 45), _WEAR, plural=True),
    _t("women's maxi dress", "Women's Maxi Dress", _WOMEN + ("dresses",), APPAREL_ATTRS,
       _APPAREL_OPTS, (20, 80), _WEAR),
    _t("women's leggings", "Women's Leggings", _WOMEN + ("pants",), APPAREL_ATTRS, _APPAREL_OPTS,
       (12, 45), _WEAR, plural=True),
    _t("women's blouse", "Women's Blouse", _WOMEN + ("tops",), APPAREL_ATTRS, _APPAREL_OPTS,
       (15, 50), _WEAR),
    _t("women's cardigan", "Women's Cardigan Sweater", _WOMEN + ("sweaters",), APPAREL_ATTRS,
       _APPAREL_OPTS, (20, 65), _WEAR),
    _t("running shoes", "Running Shoes", _SHOES + ("athletic",), SHOE_ATTRS, _SHOE_OPTS, (30, 140),
       _WEAR, plural=True),
    _t("hiking boots", "Hiking Boots", _SHOES + ("boots",), SHOE_ATTRS, _SHOE_OPTS, (45, 180),
       _WEAR, plural=True),
    _t("sandals", "Sandals", _SHOES + ("sandals",), SHOE_ATTRS, _SHOE_OPTS, (15, 60), _WEAR,
       plural=True),
    _t("house slippers", "House Slippers", _SHOES + ("slippers",), SHOE_ATTRS, _SHOE_OPTS, (12, 40),
       _WEAR, plural=True),
    _t("clip-in hair extensions", "Clip in Hair Extensions", _HAIR + ("extensions",), HAIR_ATTRS,
       (("color", HAIR_COLORS), ("length", HAIR_LENGTHS)), (20, 120), _BEAUTY, plural=True),
    _t("lace front wig", "Lace Front Wig", _HAIR + ("wigs",), HAIR_ATTRS,
       (("color", HAIR_COLORS), ("length", HAIR_LENGTHS)), (30, 200), _BEAUTY),
    _t("shampoo", "Shampoo", _HAIR + ("shampoo & conditioner",), HAIR_ATTRS,
       (("size", LIQUID_SIZES), ("scent", SCENTS)), (6, 35), _BEAUTY),
    _t("hair conditioner", "Hair Conditioner", _HAIR + ("shampoo & conditioner",), HAIR_ATTRS,
       (("size", LIQUID_SIZES), ("scent", SCENTS)), (6, 35), _BEAUTY),
    _t("hair oil", "Hair Oil Serum", _HAIR + ("styling products",), HAIR_ATTRS,
       (("size", SKIN_SIZES),), (8, 40), _BEAUTY),
    _t("face moisturizer", "Face Moisturizer Cream", _SKIN + ("face",), SKIN_ATTRS,
       (("size", SKIN_SIZES),), (9, 60), _BEAUTY),
    _t("sunscreen", "Sunscreen Lotion", _SKIN + ("sun care",), SKIN_ATTRS,
       (("size", SKIN_SIZES), ("scent", SCENTS)), (7, 35), _BEAUTY),
    _t("face serum", "Face Serum", _SKIN + ("face",), SKIN_ATTRS, (("size", SKIN_SIZES),), (10, 70),
       _BEAUTY),
    _t("eye cream", "Eye Cream", _SKIN + ("eyes",), SKIN_ATTRS, (("size", SKIN_SIZES),), (10, 65),
       _BEAUTY),
    _t("body lotion", "Body Lotion", _SKIN + ("body",), SKIN_ATTRS,
       (("size", LIQUID_SIZES), ("scent", SCENTS)), (6, 30), _BEAUTY),
    _t("protein bars", "Protein Bars", _SNACKS + ("bars",), FOOD_ATTRS,
       (("flavor", FLAVORS), ("size", FOOD_SIZES)), (12, 45), _FOOD, plural=True),
    _t("trail mix", "Trail Mix", _SNACKS + ("nuts & seeds",), FOOD_ATTRS,
       (("flavor", FLAVORS), ("size", FOOD_SIZES)), (6, 30), _FOOD),
    _t("potato chips", "Potato Chips", _SNACKS + ("chips & crisps",), FOOD_ATTRS,
       (("flavor", FLAVORS), ("size", FOOD_SIZES)), (4, 25), _FOOD, plural=True),
    _t("beef jerky", "Beef Jerky", _SNACKS + ("jerky",), FOOD_ATTRS,
       (("flavor", FLAVORS), ("size", FOOD_SIZES)), (8, 40), _FOOD),
    _t("granola", "Granola Cereal", _SNACKS + ("breakfast",), FOOD_ATTRS,
       (("flavor", FLAVORS), ("size", FOOD_SIZES)), (5, 25), _FOOD),
    _t("green tea", "Green Tea Bags", _DRINKS + ("tea",), DRINK_ATTRS,
       (("flavor", DRINK_FLAVORS), ("size", FOOD_SIZES)), (5, 30), _FOOD),
    _t("coffee beans", "Whole Bean Coffee", _DRINKS + ("coffee",), DRINK_ATTRS,
       (("flavor", DRINK_FLAVORS), ("size", FOOD_SIZES)), (9, 45), _FOOD, plural=True),
    _t("sparkling water", "Sparkling Water", _DRINKS + ("water",), DRINK_ATTRS,
       (("flavor", DRINK_FLAVORS), ("size", FOOD_SIZES)), (6, 30), _FOOD),
    _t("office chair", "Office Chair", _FURNITURE + ("home office",), FURNITURE_ATTRS,
       (("color", WOOD_COLORS),), (60, 300), _HOME),
    _t("bookshelf", "Bookshelf", _FURNITURE + ("living room",), FURNITURE_ATTRS,
       (("size", SHELF_SIZES), ("color", WOOD_COLORS)), (40, 220), _HOME),
    _t("coffee table", "Coffee Table", _FURNITURE + ("living room",), FURNITURE_ATTRS,
       (("color", WOOD_COLORS),), (50, 260), _HOME),
    _t("nightstand", "Nightstand", _FURNITURE + ("bedroom",), FURNITURE_ATTRS,
       (("size", FURNITURE_SIZES), ("color", WOOD_COLORS)), (30, 160), _HOME),
    _t("bar stools", "Bar Stools", _FURNITURE + ("kitchen",), FURNITURE_ATTRS,
       (("color", WOOD_COLORS),), (50, 240), _HOME, plural=True),
    _t("tv stand", "TV Stand", _FURNITURE + ("living room",), FURNITURE_ATTRS,
       (("size", FURNITURE_SIZES), ("color", WOOD_COLORS)), (60, 280), _HOME),
    _t("coffee mug", "Coffee Mug", _KITCHEN + ("drinkware",), KITCHEN_ATTRS,
       (("size", DRINKWARE_SIZES), ("color", COLORS)), (8, 30), _HOME),
    _t("water bottle", "Water Bottle", _KITCHEN + ("drinkware",), KITCHEN_ATTRS,
       (("size", DRINKWARE_SIZES), ("color", COLORS)), (10, 45), _HOME),
    _t("travel tumbler", "Travel Tumbler", _KITCHEN + ("drinkware",), KITCHEN_ATTRS,
       (("size", DRINKWARE_SIZES), ("color", COLORS)), (12, 40), _HOME),
    _t("frying pan", "Frying Pan Skillet", _KITCHEN + ("cookware",), KITCHEN_ATTRS,
       (("size", PAN_SIZES),), (15, 90), _HOME),
    _t("cutting board", "Cutting Board", _KITCHEN + ("prep",), KITCHEN_ATTRS,
       (("size", FURNITURE_SIZES),), (10, 50), _HOME),
    _t("food storage containers", "Food Storage Containers", _KITCHEN + ("storage",), KITCHEN_ATTRS,
       (("size", FOOD_SIZES),), (12, 45), _HOME, plural=True),
    _t("phone case", "Phone Case", _ELECTRONICS + ("cell phone",), MOBILE_ATTRS,
       (("size", PHONE_MODELS), ("color", COLORS)), (8, 40), _GEAR),
    _t("screen protector", "Screen Protector", _ELECTRONICS + ("cell phone",), MOBILE_ATTRS,
       (("size", PHONE_MODELS),), (6, 25), _GEAR),
    _t("usb c cable", "USB C Charging Cable", _ELECTRONICS + ("cables",), MOBILE_ATTRS,
       (("size", CABLE_LENGTHS), ("color", COLORS)), (6, 25), _GEAR),
    _t("bluetooth speaker", "Bluetooth Speaker", ("electronics", "audio", "speakers"), AUDIO_ATTRS,
       (("color", COLORS),), (20, 150), _GEAR),
    _t("wireless earbuds", "Wireless Earbuds", ("electronics", "audio", "headphones"), AUDIO_ATTRS,
       (("color", COLORS),), (20, 200), _GEAR, plural=True),
    _t("over ear headphones", "Over Ear Headphones", ("electronics", "audio", "headphones"),
       AUDIO_ATTRS, (("color", COLORS),), (25, 250), _GEAR, plural=True),
    _t("power bank", "Portable Charger Power Bank", _ELECTRONICS + ("chargers",), MOBILE_ATTRS,
       (("color", COLORS),), (15, 70), _GEAR),
)
# fmt: on

# Nouns a POS tagger would mark in titles; stands in for WebShop's spaCy parse when
# reading the nouns of a title (r_type). Brand names are added per catalogue.
EXTRA_NOUNS = frozenset(
    [
        "men",
        "women",
        "shirt",
        "polo",
        "hoodie",
        "jeans",
        "shorts",
        "dress",
        "leggings",
        "blouse",
        "cardigan",
        "sweater",
        "shoes",
        "boots",
        "sandals",
        "slippers",
        "hair",
        "extensions",
        "wig",
        "shampoo",
        "conditioner",
        "oil",
        "serum",
        "face",
        "moisturizer",
        "cream",
        "sunscreen",
        "lotion",
        "eye",
        "body",
        "protein",
        "bars",
        "trail",
        "mix",
        "chips",
        "beef",
        "jerky",
        "granola",
        "cereal",
        "tea",
        "bags",
        "bean",
        "coffee",
        "water",
        "office",
        "chair",
        "bookshelf",
        "table",
        "nightstand",
        "bar",
        "stools",
        "tv",
        "stand",
        "mug",
        "bottle",
        "tumbler",
        "pan",
        "skillet",
        "board",
        "containers",
        "phone",
        "case",
        "screen",
        "protector",
        "cable",
        "speaker",
        "earbuds",
        "headphones",
        "charger",
        "bank",
        "sleeve",
        "waistband",
        "sole",
        "foam",
        "mesh",
        "insole",
        "strap",
        "width",
        "scalp",
        "argan",
        "skin",
        "acid",
        "vitamin",
        "lines",
        "circles",
        "spf",
        "ingredients",
        "sugar",
        "carb",
        "grain",
        "flavors",
        "electrolytes",
        "wood",
        "frame",
        "storage",
        "space",
        "room",
        "back",
        "support",
        "leather",
        "steel",
        "wall",
        "glass",
        "definition",
        "battery",
        "life",
        "microphone",
        "cotton",
        "spandex",
        "polyester",
        "blend",
        "closure",
        "fit",
    ]
)

BRAND_SYLLABLES = (
    "ar",
    "bel",
    "cor",
    "da",
    "el",
    "fen",
    "gal",
    "hol",
    "is",
    "jun",
    "kel",
    "lum",
    "mor",
    "nor",
    "ob",
    "pra",
    "quin",
    "ros",
    "sol",
    "tav",
    "ul",
    "ven",
    "wyn",
    "xan",
    "yor",
    "zel",
)

FEATURE_BLURBS = (
    "built to hold up to daily use",
    "a customer favourite for its value",
    "designed and tested by our product team",
    "checked by hand before it ships",
    "backed by a one-year satisfaction promise",
    "made in a certified facility",
)

USES = {
    "clothing, shoes & jewelry": ("everyday wear", "the gym", "weekends", "travel", "work"),
    "beauty & personal care": ("daily routines", "travel", "gifting", "salon results"),
    "grocery & gourmet food": ("snacking", "the office", "road trips", "lunch boxes"),
    "home & kitchen": ("small apartments", "family homes", "the office", "gifting"),
    "electronics": ("commuting", "travel", "the office", "workouts"),
}

REVIEW_LINES = (
    ("Exactly as described.", 5),
    ("Good value for the price.", 4),
    ("Works fine, shipping was slow.", 3),
    ("Would buy again.", 5),
    ("Not bad, a bit smaller than expected.", 3),
    ("Great quality.", 4),
)
