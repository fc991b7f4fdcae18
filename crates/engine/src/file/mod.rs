//! Rollout files: the frames of format version 2 ([`frames`]).

pub mod frames;
