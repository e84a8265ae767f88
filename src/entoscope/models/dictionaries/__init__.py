"""What a dictionary is (a sparse autoencoder or transcoder over one site), how it is read from and written
to SAELens's folder format, and the catalogue of names it is found by (the bundled demo dictionaries,
registered ones, SAELens releases). Feature sites (sites.py, models/features.py) and the feature operations
above (entoscope.dictionaries) read dictionaries from here; users import these names from
`entoscope.dictionaries`. See docs/features.md.
"""

from .catalog import DEMO, as_dictionary, for_site, get_dictionary, register_dictionary, release_members
from .dictionary import ARCHITECTURES, Dictionary
from .saelens import from_sae_lens, read_folder, write_folder

__all__ = ["ARCHITECTURES", "DEMO", "Dictionary", "as_dictionary", "for_site", "from_sae_lens", "get_dictionary",
           "read_folder", "register_dictionary", "release_members", "write_folder"]
