//! The scale model's schedule against a real run's: ranks run training-like steps with a
//! timeline, and the harness then feeds the votes the timeline recorded to the model's
//! decision functions (`ferrovod::sim::step::Job`): the groups or plan it learns from them,
//! the batches it cuts each vote into and each batch's route and codec must be what ran.

use std::collections::HashMap;

use ferrovod::config::Config;
use ferrovod::fusion::planner;
use ferrovod::message::{CPU_DEVICE, Response};
use ferrovod::sim::network::{Fabric, Topology};
use ferrovod::sim::step::{Host, Job, Learned};

use super::*;

/// Tensors per step (`common::step_tensors`: four dtypes, a few large enough to run alone).
const TENSORS: usize = 24;

/// Rank side: steps of `TENSORS` allreduces in a per-rank random order with jitter, each
/// result checked against the sum every rank computes itself.
pub(crate) fn schedule() {
    init();
    let mut rng = Lcg(0x5c4e + rank() as u64 * 17);
    for step in 0..8 {
        offline_step(&mut rng, step, TENSORS, &[], 0);
    }
    finish_job();
}

/// The raw value of `key` in a timeline line (one event per line, as the library writes it):
/// a number, a string or a list, as written.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!("\"{key}\": "))? + key.len() + 4;
    let rest = &line[at..];
    let end = match rest.as_bytes().first()? {
        b'[' => rest.find(']')? + 1,
        b'"' => rest[1..].find('"')? + 2,
        _ => rest.find([',', '}'])?,
    };
    Some(&rest[..end])
}

fn strings(list: &str) -> Vec<String> {
    let inner = list.trim_start_matches('[').trim_end_matches(']').trim();
    if inner.is_empty() {
        return Vec::new();
    }
    inner
        .split(", ")
        .map(|s| s.trim_matches('"').to_string())
        .collect()
}

fn numbers(list: &str) -> Vec<usize> {
    strings(list).iter().map(|s| s.parse().unwrap()).collect()
}

/// A batch as the timeline recorded it: its tensors, route and codec.
#[derive(Debug, PartialEq)]
struct Ran {
    tensors: Vec<String>,
    route: String,
    codec: String,
}

struct Vote {
    tensors: Vec<String>,
    groups: Vec<usize>,
    batches: Vec<Ran>,
}

/// The response every rank agreed on for the scenario's tensor `name`.
fn response(name: &str, tensors: &HashMap<String, (usize, DataType)>) -> Response {
    let (len, dtype) = tensors[name];
    Response::allreduce(name, dtype, &[len as i64], ReduceOp::Sum, CPU_DEVICE)
}

/// Checks the timeline of a `schedule` run at `np` ranks under `env` against the model.
pub(crate) fn check_schedule(
    path: &std::path::Path,
    np: usize,
    env: &[(&str, &str)],
) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("timeline missing: {e}"))?;
    // the scenario's settings, over what the ranks inherited from this process
    let cfg = Config::from_lookup(&|key| {
        (env.iter())
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.to_string())
            .or_else(|| std::env::var(key).ok())
    });
    let per_node = cfg.local_size_override.unwrap_or(np);
    let topology = Topology {
        nodes: np / per_node,
        per_node,
    };
    // the clock plays no part in these decisions
    let link = ferrovod::collective::cost::Link {
        alpha: 1e-6,
        beta: 1e-9,
    };
    let fabric = Fabric {
        inside: link,
        nic: link,
    };
    let host = Host {
        lanes: 1,
        ..Host::default()
    };
    let job = Job::from_config(topology, fabric, host, false, &cfg);
    let tensors: HashMap<String, (usize, DataType)> = step_tensors(TENSORS, &[], 0)
        .into_iter()
        .map(|(n, len, d)| (n, (len, d)))
        .collect();
    // the timeline's votes and batches, in order; the frozen plan's batches by index
    let mut votes: Vec<Vote> = Vec::new();
    let mut plan: HashMap<usize, Ran> = HashMap::new();
    for line in text.lines() {
        let name = field(line, "name");
        if name == Some("\"VOTE\"") {
            votes.push(Vote {
                tensors: strings(field(line, "tensors").ok_or("a vote without tensors")?),
                groups: numbers(field(line, "groups").ok_or("a vote without groups")?),
                batches: Vec::new(),
            });
        } else if name == Some("\"BATCH\"") {
            let route = strings(field(line, "route").ok_or("no route")?).remove(0);
            let codec = strings(field(line, "codec").ok_or("no codec")?).remove(0);
            if let Some(index) = field(line, "plan") {
                let tensors = strings(field(line, "tensors").ok_or("no tensors")?);
                let ran = Ran {
                    tensors,
                    route,
                    codec,
                };
                let index: usize = index.parse().map_err(|_| "a plan index")?;
                if let Some(before) = plan.insert(index, ran)
                    && before != plan[&index]
                {
                    return Err(format!("plan batch {index} changed: {before:?}"));
                }
            } else {
                let vote = votes.last_mut().ok_or("a batch before any vote")?;
                let members = numbers(field(line, "members").ok_or("no members")?);
                vote.batches.push(Ran {
                    tensors: members.iter().map(|m| vote.tensors[*m].clone()).collect(),
                    route,
                    codec,
                });
            }
        }
    }
    // the steps' votes (the job's last ones, its shutdown, hold other kinds)
    votes.retain(|v| v.tensors.iter().all(|t| tensors.contains_key(t)));
    if votes.is_empty() {
        return Err("the timeline recorded no vote of the steps".into());
    }
    let resps: Vec<Vec<Response>> = (votes.iter())
        .map(|v| v.tensors.iter().map(|t| response(t, &tensors)).collect())
        .collect();
    // every vote: the model's batches, routes and codecs are the ones that ran
    let (mut batches, mut routes) = (0, std::collections::BTreeSet::new());
    for (v, vote) in votes.iter().enumerate() {
        let refs: Vec<&Response> = resps[v].iter().collect();
        let model: Vec<Ran> = (job.plan_vote(&refs, &vote.groups).into_iter())
            .map(|b| Ran {
                tensors: b.members.iter().map(|m| vote.tensors[*m].clone()).collect(),
                route: b.route.name().to_string(),
                codec: b.codec.label(),
            })
            .collect();
        if model != vote.batches {
            return Err(format!(
                "vote {v} ({:?}, groups {:?}): ran {:?}, the model has {model:?}",
                vote.tensors, vote.groups, vote.batches
            ));
        }
        batches += model.len();
        routes.extend(model.into_iter().map(|b| (b.route, b.codec)));
    }
    // what the model learns from these votes is what the run went on with: the groups its
    // later votes carry, or the frozen plan's batches
    let learned = job
        .learn(resps.iter().map(Vec::as_slice))
        .ok_or("the model learned nothing from the run's votes")?;
    let learned = match (learned, plan.is_empty()) {
        (Learned::Groups(g), true) | (Learned::Plan(g), false) => g,
        (other, _) => {
            return Err(format!(
                "the model learned {other:?}; the run froze {} plan batches",
                plan.len()
            ));
        }
    };
    let mut learned_sorted = learned.clone();
    learned_sorted.sort();
    let ran: Vec<Vec<String>> = if plan.is_empty() {
        let mut seen: Vec<Vec<String>> = Vec::new();
        for vote in &votes {
            let mut at = 0;
            for g in &vote.groups {
                let group = vote.tensors[at..at + g].to_vec();
                at += g;
                if !seen.contains(&group) {
                    seen.push(group);
                }
            }
        }
        seen
    } else {
        let mut by_index: Vec<_> = plan.iter().collect();
        by_index.sort_by_key(|(i, _)| **i);
        for (_, b) in &by_index {
            let head = response(&b.tensors[0], &tensors);
            let batch: Vec<Response> = (b.tensors.iter()).map(|t| response(t, &tensors)).collect();
            let refs: Vec<&Response> = batch.iter().collect();
            let codec = planner::codec(&head, &job.codecs);
            let route = job.route(&refs, codec);
            if (route.name(), codec.label()) != (b.route.as_str(), b.codec.clone()) {
                return Err(format!(
                    "plan batch {:?} ran as {} {}, the model has {} {}",
                    b.tensors,
                    b.route,
                    b.codec,
                    route.name(),
                    codec.label()
                ));
            }
            routes.insert((route.name().to_string(), codec.label()));
        }
        by_index
            .into_iter()
            .map(|(_, b)| b.tensors.clone())
            .collect()
    };
    let mut ran_sorted = ran.clone();
    ran_sorted.sort();
    // a plan's batches run in its order; groups are voted in whichever order they complete
    let same = match plan.is_empty() {
        true => ran_sorted == learned_sorted,
        false => ran == learned,
    };
    if !same {
        return Err(format!(
            "the run went on with {ran:?}, the model learned {learned:?}"
        ));
    }
    println!(
        "    schedule: {} votes, {batches} batches, {} learned batches, routes {routes:?}: as the model",
        votes.len(),
        learned.len()
    );
    Ok(())
}
