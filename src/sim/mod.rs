//! A scale model of ferrovod: the library's own decisions (fusion planner, algorithm choice,
//! codecs' byte counts, negotiation's rounds) driven for N simulated ranks over an α-β network
//! model of nodes × ranks per node, to predict what cannot be measured on one machine. The
//! `ferrovod-sim` program calibrates it against measured steps and prints its predictions.

pub mod network;
pub mod step;
