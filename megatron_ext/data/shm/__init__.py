"""The node loader's shared memory: one producer per node (:mod:`.producer`, with
:mod:`.readahead`) fills a ring of batches (:mod:`.ring`) in a segment (:mod:`.segment`,
:mod:`.segment_file`, :mod:`.private`) that every rank reads (:mod:`.node_loader`, waiting through
:mod:`.polling`)."""
