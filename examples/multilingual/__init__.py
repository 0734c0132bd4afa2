"""The multilingual experiment: a drafter-verifier family trained on real multilingual text, its disparity on the
MGSM languages, and its repair by s-CDF and the baselines (see README.md)."""
