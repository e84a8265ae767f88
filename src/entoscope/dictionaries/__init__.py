"""Dictionaries: sparse autoencoders and transcoders, read from SAELens's format, trained, used as sites.

    d = entoscope.dictionaries.load_dictionary("demo/resid_post.1")   # or a SAELens folder, a registered name
    f = d.encode(x); x_hat = d.decode(f); err = d.error(x)
    entoscope.dictionaries.register_dictionary("mine", sae_lens_sae)  # then Sites(dictionary="mine", ...)

Operations on features (each registered by name): `FeatureDLA` (feature_dla: DLA per feature),
`DecoderLens` (decoder_lens: decoder rows through W_U), `FeatureGraph` (feature_graph: attribution graphs
with feature, error and token nodes, replacement and completeness scores). Probing and patching take feature Sites directly.

See docs/features.md.
"""

from ..models.dictionaries import (ARCHITECTURES, DEMO, Dictionary, as_dictionary, for_site, from_sae_lens,
                                   get_dictionary, read_folder, register_dictionary, release_members,
                                   write_folder)
from .dla import FeatureDLA
from .graph import FeatureGraph
from .lens import DecoderLens


load_dictionary = get_dictionary
save_dictionary = write_folder

__all__ = ["ARCHITECTURES", "DEMO", "DecoderLens", "Dictionary", "FeatureDLA", "FeatureGraph", "as_dictionary", "for_site", "from_sae_lens", "get_dictionary",
           "load_dictionary", "read_folder", "register_dictionary", "release_members", "save_dictionary",
           "write_folder"]
