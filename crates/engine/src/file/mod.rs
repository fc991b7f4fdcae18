//! Rollout files: the frames of format version 2 ([`frames`]) and version 1 ([`frames_v1`]).

pub mod frames;
pub mod frames_v1;
