"""Values shared by both sides: core types, the codec, value checks, the roofline."""
