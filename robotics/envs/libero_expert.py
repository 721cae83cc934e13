"""Scripted pick-and-place expert for LIBERO (libero_spatial, libero_object).

The expert reads the task's single goal predicate (``('on', obj, target)`` or
``('in', obj, region)``) and drives the Panda with the OSC_POSE *delta*
controller (20 Hz, 1.0 = 5 cm / 0.5 rad per step) through a phase machine:

    APPROACH  -> rise to a safe height, then move above the grasp point
    DESCEND   -> go straight down to the grasp point
    CLOSE     -> close the gripper until the fingers stop moving
    LIFT      -> lift to a carry height that clears every obstacle on the way
    TRANSPORT -> move so that the *object* (not the hand) is above the target
    LOWER     -> lower the object onto / into the target
    RELEASE   -> open the gripper
    RETREAT   -> move up and hold

Every phase is a P-controller (plus a small integral term against the OSC's
steady-state error) on the end-effector position, computed each step from
the simulator's live object/geom poses, with the gripper pointing straight
down; the rotation deltas only hold that orientation and a planned yaw.

Grasp point per object shape, from the object's collision-geom AABB:
  * objects wider than the gripper opening in both x and y (bowls): rim
    grasp -- the fingers straddle the bowl wall (2.6 mm thick), 1-1.6 cm
    below the rim. Candidates: 24 directions around the rim x 3 heights x
    3 finger pre-openings (7.8 / 4 / 2.4 cm); the outer finger and the hand,
    swept from the grasp height up, must clear every other collision geom by
    5 mm (oriented-box distance); among feasible ones prefer the lowest grasp,
    then the least wrist yaw, the widest opening, the side facing the target.
    This matters for the bowl in the drawer, whose walls leave ~1 cm;
  * everything else (cans, boxes, bottles): grasp at the AABB centre, fingers
    closing across a side narrower than the opening (least yaw), at mid height but high
    enough that the hand clears the object's top (tall bottles are therefore
    grasped near their top) and the finger tips clear the floor.

Robustness: a grasp = both fingers in contact with the object (MuJoCo
contacts; finger width is useless for the thin bowl wall). If the fingers
close on nothing, the object does not rise with the hand, or it slips out
during transport (3 steps without grasp contact or >4 cm offset change), the expert re-plans the grasp
from the object's current pose (up to 4 attempts); every phase has a
time-out that moves on (or re-grasps) instead of stalling.

What success requires (read from libero/envs/object_states):
  * ``On(a, b)`` with b an object: b.z <= a.z, a and b in contact, and the
    *body origins* of a and b within 3 cm in xy -- so the expert centres the
    object's body origin (not the hand) on the target's body origin.
  * ``In(a, region)``: the body origin of a inside the region's box (its z
    lower bound lowered by 1 cm); site "contact" is always True.

Caveat (LIBERO): fixtures (wooden cabinet, stove) are re-placed at random by
every env.reset() and are *not* part of the saved init states, so a bowl
"in the drawer" / "on the cabinet" can start wedged against or intersecting a
drawer wall; results therefore also depend on how many resets preceded an
episode. The rim-grasp planner checks the real drawer geometry every time.

Measured success (scripts/libero_expert_success.py; init states in order,
10 settle steps, 280-step limit, one env per task):
  noise 0, 50 states/task:
    libero_spatial  task 0-9: 1.00 .94 1.00 1.00 .88 .92 1.00 1.00 .98 .94 (mean .966)
    libero_object   task 0-9: 1.00 .98 1.00 1.00 1.00 1.00 1.00 1.00 1.00 1.00 (mean .998)
  noise 0.1, 10 states/task:
    libero_object   task 0-9: 1.00 1.00 1.00 1.00 .90 1.00 1.00 1.00 1.00 1.00 (mean .99)
    libero_spatial  task 0-9: 1.00 1.00 1.00 1.00 .60 1.00 .90 .90 .90 .70 (mean .90)
Only libero_spatial task 4 (bowl in the top drawer) is below 90 % at noise 0
(0.88); with noise the cabinet tasks (4 drawer, 9 bowl on cabinet) suffer
most: the thin-rim pinch near a fixture has mm margins.
"""

from __future__ import annotations

import numpy as np

# --- gripper / controller constants (Panda gripper in robosuite 1.4) -------
POS_SCALE = 0.05  # action 1.0 -> 5 cm target offset
ROT_SCALE = 0.5  # action 1.0 -> 0.5 rad
MAX_OPEN = 0.066  # widest object extent (m) we try to grasp across
HAND_CLEAR = 0.018  # hand bottom is 2.4 cm above the grip site; keep margin
TIP_CLEAR = 0.015  # finger tips reach 1.3 cm below the grip site
FINGER_REACH = 0.07  # how far a finger reaches out from the grip site (y)
MAX_ATTEMPTS = 4


APPROACH, DESCEND, CLOSE, LIFT, TRANSPORT, LOWER, RELEASE, RETREAT = range(8)
PHASE_NAMES = ["approach", "descend", "close", "lift", "transport", "lower", "release", "retreat"]
# per-phase time-outs (env steps)
TIMEOUT = {APPROACH: 70, DESCEND: 35, CLOSE: 14, LIFT: 45, TRANSPORT: 90, LOWER: 40, RELEASE: 8}


def expert_supports(goal_state) -> bool:
    """True for a single ``on``/``in`` pick-and-place goal the expert handles."""
    try:
        goals = list(goal_state)
    except TypeError:
        return False
    if len(goals) != 1:
        return False
    g = goals[0]
    return len(g) == 3 and str(g[0]).lower() in ("on", "in")


def _rotz(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def _log_rot(R: np.ndarray) -> np.ndarray:
    """Axis-angle vector of a rotation matrix."""
    cos = np.clip((np.trace(R) - 1.0) / 2.0, -1.0, 1.0)
    ang = float(np.arccos(cos))
    if ang < 1e-6:
        return np.zeros(3)
    if ang > np.pi - 1e-3:
        d = np.clip((np.diag(R) + 1.0) / 2.0, 0.0, None)
        k = int(np.argmax(d))
        axis = np.sqrt(d)
        for j in range(3):
            if j != k and R[k, j] + R[j, k] < 0:
                axis[j] = -axis[j]
        return axis / np.linalg.norm(axis) * ang
    v = np.array([R[2, 1] - R[1, 2], R[0, 2] - R[2, 0], R[1, 0] - R[0, 1]])
    return v / (2.0 * np.sin(ang)) * ang


class _Geoms:
    """Collision geoms of LIBERO objects/fixtures: live world AABBs and
    oriented-box distances (geom_aabb is the geom's local bounding box)."""

    def __init__(self, penv):
        self.sim = penv.sim
        m = getattr(self.sim.model, "_model", self.sim.model)
        self.m = m
        parent = np.asarray(m.body_parentid)
        roots = {}
        for name, bid in penv.obj_body_id.items():
            roots[int(bid)] = name
        owner = {}
        for b in range(m.nbody):
            c = b
            while c > 0 and c not in roots:
                c = int(parent[c])
            if c in roots:
                owner[b] = roots[c]
        self.by_name: dict[str, np.ndarray] = {}
        collide = (np.asarray(m.geom_contype) != 0) | (np.asarray(m.geom_conaffinity) != 0)
        gb = np.asarray(m.geom_bodyid)
        for g in range(m.ngeom):
            if not collide[g]:
                continue
            nm = owner.get(int(gb[g]))
            if nm is not None:
                self.by_name.setdefault(nm, []).append(g)
        self.by_name = {k: np.asarray(v, dtype=int) for k, v in self.by_name.items()}
        signs = np.array([[sx, sy, sz] for sx in (-1, 1) for sy in (-1, 1) for sz in (-1, 1)], float)
        self.signs = signs

    def boxes(self, name):
        """(n, 2, 3) per-geom world AABBs of body `name` (empty if unknown)."""
        gs = self.by_name.get(name)
        if gs is None or len(gs) == 0:
            return np.zeros((0, 2, 3))
        d = getattr(self.sim.data, "_data", self.sim.data)
        aabb = np.asarray(self.m.geom_aabb)[gs]  # (n, 6): centre, half-size (local)
        corners = aabb[:, None, :3] + self.signs[None] * aabb[:, None, 3:]  # (n, 8, 3)
        R = np.asarray(d.geom_xmat)[gs].reshape(-1, 3, 3)
        w = np.einsum("nij,nkj->nki", R, corners) + np.asarray(d.geom_xpos)[gs][:, None, :]
        return np.stack([w.min(1), w.max(1)], axis=1)

    def min_dist(self, pts, gids) -> float:
        """Smallest distance from any of pts (n, 3) to the oriented boxes of geoms gids."""
        if len(gids) == 0 or len(pts) == 0:
            return np.inf
        d = getattr(self.sim.data, "_data", self.sim.data)
        R = np.asarray(d.geom_xmat)[gids].reshape(-1, 3, 3)
        p = np.asarray(d.geom_xpos)[gids]
        aabb = np.asarray(self.m.geom_aabb)[gids]
        rel = pts[:, None, :] - p[None]  # (P, G, 3)
        loc = np.einsum("gji,pgj->pgi", R, rel) - aabb[None, :, :3]
        out = np.maximum(np.abs(loc) - aabb[None, :, 3:], 0.0)
        return float(np.sqrt((out ** 2).sum(-1)).min())

    def aabb(self, name):
        b = self.boxes(name)
        if len(b) == 0:
            return None
        return np.stack([b[:, 0].min(0), b[:, 1].max(0)])


class LiberoScriptedExpert:
    """Phase-machine pick-and-place expert; see the module docstring."""

    def __init__(self, noise: float = 0.0, seed: int = 0):
        self.noise = float(noise)
        self.rng = np.random.default_rng(seed)
        self.verbose = False
        self._ready = False

    # ------------------------------------------------------------------ setup
    def reset(self, control_env) -> None:
        penv = getattr(control_env, "env", control_env)
        self.penv = penv
        self.sim = penv.sim
        goal = penv.parsed_problem["goal_state"]
        if not expert_supports(goal):
            raise ValueError(f"unsupported goal {goal}")
        kind, obj, tgt = goal[0]
        self.kind, self.obj, self.tgt = str(kind).lower(), obj, tgt
        self.tgt_is_site = tgt in penv.object_sites_dict and tgt not in penv.objects_dict
        self.tgt_parent = penv.object_sites_dict[tgt].parent_name if self.tgt_is_site else tgt
        self.geoms = _Geoms(penv)
        self.obj_bid = penv.obj_body_id[obj]
        robot = penv.robots[0]
        self.eef_sid = robot.eef_site_id
        self.grip_idx = list(robot._ref_gripper_joint_pos_indexes)
        self.finger_geoms = []
        for side in ("left_finger", "right_finger"):
            ids = set()
            for gname in robot.gripper.important_geoms[side]:
                try:
                    ids.add(int(self.sim.model.geom_name2id(gname)))
                except Exception:  # noqa: BLE001 - name not in model
                    pass
            self.finger_geoms.append(np.asarray(sorted(ids), dtype=int))
        self.obj_geoms = self.geoms.by_name[obj]
        # obstacles: everything but the object itself and big support surfaces
        self.obstacles = []
        for name in list(penv.objects_dict) + list(getattr(penv, "fixtures_dict", {})):
            if name == obj or name not in self.geoms.by_name:
                continue
            lname = name.lower()
            if "table" in lname or "floor" in lname:
                continue
            self.obstacles.append(name)
        # gripper frame: keep the grip site pointing straight down, with the
        # initial yaw; remember the finger-closing axis in the site frame
        _, R0 = self._eef()
        x = R0[:, 0].copy()
        x[2] = 0.0
        x /= np.linalg.norm(x)
        z = np.array([0.0, 0.0, -1.0])
        self.R_down0 = np.stack([x, np.cross(z, x), z], axis=1)
        m = self.sim.model
        tips = [self.sim.data.body_xpos[m.body_name2id(n)] for n in self._finger_bodies(robot)]
        f_world = np.asarray(tips[1]) - np.asarray(tips[0])
        self.f_local = R0.T @ f_world / max(np.linalg.norm(f_world), 1e-9)
        self.phase = APPROACH
        self.phase_t = 0
        self._integ = np.zeros(3)
        self._no_grasp = 0
        self.t = 0
        self.attempts = 0
        self.hold_pos = None
        self.done = False
        self._ready = True
        self._plan_grasp()

    def _finger_bodies(self, robot):
        """Names of the two finger bodies (left, right) of the gripper."""
        m = self.sim.model
        out = []
        for side in self.finger_geoms:
            out.append(m.body_id2name(int(np.asarray(m.geom_bodyid)[side[0]])))
        return out

    def _yaw_for_axis(self, u):
        """Rotation about world z so that the fingers close along horizontal axis u."""
        f0 = self.R_down0 @ self.f_local
        ang = np.arctan2(f0[0] * u[1] - f0[1] * u[0], f0[0] * u[0] + f0[1] * u[1])
        if ang > np.pi / 2:
            ang -= np.pi
        elif ang < -np.pi / 2:
            ang += np.pi
        return float(ang)

    # ------------------------------------------------------------- sim reads
    def _eef(self):
        d = self.sim.data
        return np.array(d.site_xpos[self.eef_sid]), np.array(d.site_xmat[self.eef_sid]).reshape(3, 3)

    def _grip_width(self) -> float:
        q = self.sim.data.qpos[self.grip_idx]
        return float(abs(q[0] - q[1]))

    def _grasping(self) -> bool:
        """Both fingers touch the object (robosuite's _check_grasp, finger bodies included)."""
        d = getattr(self.sim.data, "_data", self.sim.data)
        n = int(d.ncon)
        if n == 0:
            return False
        g1 = np.asarray(d.contact.geom1[:n])
        g2 = np.asarray(d.contact.geom2[:n])
        o1 = np.isin(g1, self.obj_geoms)
        o2 = np.isin(g2, self.obj_geoms)
        for fg in self.finger_geoms:
            if not np.any((o1 & np.isin(g2, fg)) | (o2 & np.isin(g1, fg))):
                return False
        return True

    def _obj_pos(self):
        return np.array(self.sim.data.body_xpos[self.obj_bid])

    def _obj_aabb(self):
        return self.geoms.aabb(self.obj)

    def _target_xy_and_floor(self):
        """xy the object's body origin should reach, and the z its bottom should be lowered to."""
        penv = self.penv
        if self.tgt_is_site:
            p = np.array(self.sim.data.get_site_xpos(self.tgt))
            R = np.array(self.sim.data.get_site_xmat(self.tgt)).reshape(3, 3)
            size = np.abs(R @ np.asarray(penv.object_sites_dict[self.tgt].size, float))
            if self.kind == "in":
                floor = p[2] - size[2] + 0.012
            else:
                floor = p[2] + size[2] + 0.005
            par = self.geoms.aabb(self.tgt_parent) if self.tgt_parent else None
            if par is not None and self.kind != "in":
                floor = max(floor, par[1, 2] + 0.005)
            return p[:2], floor
        box = self.geoms.aabb(self.tgt)
        p = np.array(self.sim.data.body_xpos[penv.obj_body_id[self.tgt]])
        top = box[1, 2] if box is not None else p[2]
        return p[:2], top + 0.006

    def _container_top(self) -> float:
        """Top of the container the object goes into (hand must stay above it)."""
        if self.kind == "in" and self.tgt_parent:
            box = self.geoms.aabb(self.tgt_parent)
            if box is not None:
                return float(box[1, 2])
        return -np.inf

    def _clearance_top(self, p0, p1, radius, exclude=()):
        """Highest obstacle top within `radius` of the xy segment p0->p1."""
        top = -np.inf
        n = max(2, int(np.linalg.norm(np.asarray(p1[:2]) - np.asarray(p0[:2])) / 0.02) + 1)
        pts = np.linspace(np.asarray(p0[:2], float), np.asarray(p1[:2], float), n)
        for name in self.obstacles:
            if name in exclude:
                continue
            for lo, hi in self.geoms.boxes(name):
                if hi[2] <= top:
                    continue
                d = np.maximum(np.maximum(lo[None, :2] - pts, pts - hi[None, :2]), 0.0)
                if np.min(np.hypot(d[:, 0], d[:, 1])) < radius:
                    top = hi[2]
        return top

    # ------------------------------------------------------------ grasp plan
    def _plan_grasp(self):
        box = self._obj_aabb()
        lo, hi = box
        ext = hi - lo
        ctr = (lo + hi) / 2.0
        h = ext[2]
        self.rim = bool(min(ext[0], ext[1]) > MAX_OPEN + 0.004)
        if self.rim:
            self._plan_rim(lo, hi, ctr, ext)
        else:
            ya, yb = self._yaw_for_axis(np.array([0.0, 1.0])), self._yaw_for_axis(np.array([1.0, 0.0]))
            # close across the narrower side if needed, otherwise rotate least
            if ext[1] > MAX_OPEN and ext[0] < ext[1]:
                self.yaw = yb
            elif ext[0] > MAX_OPEN and ext[1] < ext[0]:
                self.yaw = ya
            else:
                self.yaw = ya if abs(ya) <= abs(yb) else yb
            z_rel = max(h / 2.0, h - HAND_CLEAR, TIP_CLEAR)
            self.grasp_off = np.array([0.0, 0.0, z_rel])
            self.open_width = None  # fully open
        self.R_des = _rotz(self.yaw) @ self.R_down0
        # safe height for approaching: above the object and anything on the way
        eef, _ = self._eef()
        g = self._grasp_point()
        path_top = self._clearance_top(eef, g, 0.06, exclude=())
        self.approach_z = max(g[2] + 0.06, hi[2] + 0.03, path_top + 0.035)
        if self.verbose:
            print(f"[expert] plan rim={self.rim} yaw={self.yaw:.2f} off={self.grasp_off.round(3)} "
                  f"approach_z={self.approach_z:.3f} ext={ext.round(3)}")

    def _plan_rim(self, lo, hi, ctr, ext):
        """Bowl-like object: straddle its wall. Candidates: 24 directions around
        the rim x two heights x full / partial finger opening; each is scored by
        the clearance between the outer finger (and the hand) and every other
        collision geom (oriented boxes), preferring little wrist rotation, the
        lower grasp, the full opening and the side facing the target."""
        h = ext[2]
        r = min(ext[0], ext[1]) / 2.0 - 0.006
        obst = self._obstacle_geoms()
        tgt_xy, _ = self._target_xy_and_floor()
        to_tgt = tgt_xy - ctr[:2]
        best, best_score = None, None
        self._cands = []
        zs = [max(h - dz, TIP_CLEAR) for dz in (0.016, 0.013, 0.010)]
        fz = np.concatenate([[-0.012, 0.005, 0.025, 0.045], np.arange(0.07, 0.30, 0.03)])
        finger_u = np.array([(du, dv, dz) for du in (0.004, 0.016, 0.028) for dv in (-0.012, 0.0, 0.012)
                             for dz in fz])
        hand_u = np.array([(du, dv, dz) for du in (-0.09, -0.06, -0.03, 0.0, 0.03, 0.06, 0.09)
                           for dv in (-0.03, 0.04) for dz in np.arange(0.027, 0.30, 0.03)])
        for k in range(24):
            a = k * np.pi / 12.0
            u = np.array([np.cos(a), np.sin(a), 0.0])
            v = np.array([-u[1], u[0], 0.0])
            yaw = self._yaw_for_axis(u[:2])
            for zi, z_rel in enumerate(zs):
                g = np.array([ctr[0], ctr[1], lo[2] + z_rel]) + u * r
                for oi, w2 in enumerate((0.039, 0.02, 0.012)):
                    # outer finger and hand, swept from the grasp height up
                    # (the descent must be free too)
                    pts = (g + np.outer(finger_u[:, 0] + w2, u)
                           + np.outer(finger_u[:, 1], v) + np.outer(finger_u[:, 2], [0.0, 0.0, 1.0]))
                    pts = np.concatenate([pts, g + np.outer(hand_u[:, 0], u) + np.outer(hand_u[:, 1], v)
                                          + np.outer(hand_u[:, 2], [0.0, 0.0, 1.0])])
                    clear = self.geoms.min_dist(np.asarray(pts), obst)
                    # lexicographic: feasible, low grasp, little wrist rotation,
                    # wide opening, side facing the target, clearance
                    score = (clear >= 0.005, -zi, -round(abs(yaw) / (np.pi / 12)), -oi,
                             float(np.dot(u[:2], to_tgt) > 0), clear)
                    self._cands.append((k * 15, zi, w2, round(clear, 4)))
                    if best is None or score > best_score:
                        best_score = score
                        best = (yaw, u * r, z_rel, w2, clear)
        self.yaw, off, z_rel, w2, clear = best
        self.grasp_off = np.array([off[0], off[1], z_rel])
        self.open_width = None if w2 >= 0.039 else 2.0 * w2
        if self.verbose:
            print(f"[expert] rim grasp clear={clear:.3f} open={self.open_width}")

    def _obstacle_geoms(self):
        ids = [self.geoms.by_name[n] for n in self.obstacles]
        return np.concatenate(ids) if ids else np.zeros(0, dtype=int)

    def _grasp_point(self):
        lo, hi = self._obj_aabb()
        ctr = (lo + hi) / 2.0
        return np.array([ctr[0] + self.grasp_off[0], ctr[1] + self.grasp_off[1], lo[2] + self.grasp_off[2]])

    # ----------------------------------------------------------------- act
    def _set_phase(self, p):
        self._integ = np.zeros(3)
        if self.verbose:
            print(f"[expert] t={self.t} {PHASE_NAMES[self.phase]} -> {PHASE_NAMES[p]}")
        self.phase, self.phase_t = p, 0

    def _regrasp(self):
        self.attempts += 1
        if self.attempts >= MAX_ATTEMPTS:
            self._set_phase(RETREAT)
            self.hold_pos = None
            return
        self._plan_grasp()
        self._set_phase(APPROACH)

    def _move(self, eef, target, max_speed=1.0, gain=1.0):
        """P + small I controller on the eef position -> clipped delta action.
        The integral term beats the OSC's steady-state error (the arm can stall
        ~1 cm short of a target when carrying a load)."""
        err = np.asarray(target) - eef
        near = np.abs(err) < 0.03
        self._integ = np.clip(np.where(near, self._integ + err, 0.0), -0.04, 0.04)
        a = (gain * err + 0.5 * self._integ) / POS_SCALE
        n = np.max(np.abs(a))
        if n > max_speed:
            a = a * (max_speed / n)
        return a

    def act(self, control_env) -> np.ndarray:
        if not self._ready:
            self.reset(control_env)
        eef, R = self._eef()
        width = self._grip_width()
        box = self._obj_aabb()
        lo, hi = box
        obj = self._obj_pos()
        grip = -1.0
        dpos = np.zeros(3)
        ph = self.phase
        self.phase_t += 1

        if ph in (APPROACH, DESCEND) and self.open_width is not None:
            # pre-shape: partially closed fingers (feedback on the finger width)
            grip = 1.0 if width > self.open_width + 0.003 else (-1.0 if width < self.open_width - 0.003 else 0.0)
        if ph == APPROACH:
            g = self._grasp_point()
            target = np.array([g[0], g[1], self.approach_z])
            if eef[2] < self.approach_z - 0.03 and np.linalg.norm(g[:2] - eef[:2]) > 0.02:
                target[:2] = eef[:2]  # rise first, then translate
            dpos = self._move(eef, target)
            xy_err = np.linalg.norm(g[:2] - eef[:2])
            if (xy_err < 0.008 and abs(eef[2] - self.approach_z) < 0.03) or self.phase_t > TIMEOUT[APPROACH]:
                self._set_phase(DESCEND)
        elif ph == DESCEND:
            g = self._grasp_point()
            xy_err = np.linalg.norm(g[:2] - eef[:2])
            target = g.copy()
            if xy_err > 0.012:  # re-centre before going lower
                target[2] = max(eef[2], g[2])
            dpos = self._move(eef, target, max_speed=0.8)
            if (np.linalg.norm(g - eef) < 0.006) or self.phase_t > TIMEOUT[DESCEND]:
                self.hold_pos = g.copy() if np.linalg.norm(g - eef) < 0.02 else eef.copy()
                self._prev_width = width
                self._set_phase(CLOSE)
        elif ph == CLOSE:
            grip = 1.0
            dpos = self._move(eef, self.hold_pos)
            moving = abs(width - self._prev_width) > 2e-4
            self._prev_width = width
            if (self.phase_t >= 6 and not moving) or self.phase_t > TIMEOUT[CLOSE]:
                if not self._grasping():
                    self._regrasp()
                else:
                    self.lift_start_z = eef[2]
                    self.obj_start_bottom = lo[2]
                    self._plan_carry(eef, lo)
                    self._set_phase(LIFT)
        elif ph == LIFT:
            grip = 1.0
            target = np.array([self.hold_pos[0], self.hold_pos[1], self.carry_z])
            risen = eef[2] - self.lift_start_z
            dpos = self._move(eef, target, max_speed=0.3 if risen < 0.02 else 0.8)
            if (risen > 0.02 and not self._grasping()) or (risen > 0.04 and lo[2] - self.obj_start_bottom < 0.5 * risen):
                self._regrasp()
            elif abs(eef[2] - self.carry_z) < 0.015 or self.phase_t > TIMEOUT[LIFT]:
                self.grip_off = eef - obj
                self._no_grasp = 0
                self._set_phase(TRANSPORT)
        elif ph == TRANSPORT:
            grip = 1.0
            txy, _ = self._target_xy_and_floor()
            err = txy - obj[:2]
            target = np.array([eef[0] + err[0], eef[1] + err[1], self.carry_z])
            dpos = self._move(eef, target, max_speed=0.6 if self.rim else 0.9)
            if self._dropped(eef, obj, width):
                self._regrasp()
            elif np.linalg.norm(err) < 0.01 or self.phase_t > TIMEOUT[TRANSPORT]:
                self._set_phase(LOWER)
        elif ph == LOWER:
            grip = 1.0
            txy, floor = self._target_xy_and_floor()
            err = txy - obj[:2]
            bottom_off = eef[2] - lo[2]
            z = max(floor + bottom_off, self._container_top() - HAND_CLEAR + 0.006)
            target = np.array([eef[0] + err[0], eef[1] + err[1], z])
            dpos = self._move(eef, target, max_speed=0.6)
            if self._dropped(eef, obj, width):
                self._regrasp()
            elif (abs(eef[2] - z) < 0.006 and np.linalg.norm(err) < 0.01) or self.phase_t > TIMEOUT[LOWER]:
                self.hold_pos = eef.copy()
                self._set_phase(RELEASE)
        elif ph == RELEASE:
            dpos = self._move(eef, self.hold_pos)
            if self.phase_t >= TIMEOUT[RELEASE]:
                self.hold_pos = None
                self._set_phase(RETREAT)
        else:  # RETREAT
            if self.hold_pos is None:
                self.hold_pos = eef + np.array([0.0, 0.0, 0.10])
            dpos = self._move(eef, self.hold_pos, max_speed=0.5)
            self.done = True

        drot = np.clip(_log_rot(self.R_des @ R.T) / ROT_SCALE, -1.0, 1.0)
        action = np.concatenate([np.clip(dpos, -1, 1), drot, [grip]])
        if self.noise > 0:
            action = action + self.rng.normal(0.0, self.noise, size=7)
        self.t += 1
        return np.clip(action, -1.0, 1.0).astype(np.float64)

    def _dropped(self, eef, obj, width) -> bool:
        # contact flickers for a step now and then: need 3 steps without grasp
        self._no_grasp = 0 if self._grasping() else self._no_grasp + 1
        return self._no_grasp >= 3 or np.linalg.norm((eef - obj) - self.grip_off) > 0.04

    def _plan_carry(self, eef, lo):
        """Carry height: object bottom above every obstacle between here and the target."""
        txy, floor = self._target_xy_and_floor()
        bottom_off = eef[2] - lo[2]
        obj = self._obj_pos()
        top = self._clearance_top(obj, txy, 0.07, exclude=())
        top = max(top, floor, self._container_top(), lo[2] + 0.03)
        self.carry_z = top + 0.035 + bottom_off
