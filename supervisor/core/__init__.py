"""The shared vocabulary: records, states, file names. Pure: imports nothing of the others."""
