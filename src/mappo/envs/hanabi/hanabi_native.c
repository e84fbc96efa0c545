/* Hanabi's rules and views for many games on a CPU, one game after another in plain C.
 *
 * The same game as mappo/envs/hanabi/game.py (the HLE's rules and canonical observation), on the
 * same state tensors: the Python side passes the data pointers of HanabiGames.state (in the order
 * of FIELDS in native.py) and every function reads and writes them in place. Each function takes
 * a range [lo, hi) of rows; a row is game ids[i] when ids is given, else game i, so that a caller
 * can split a batch between threads (ctypes releases the GIL during a call) or work on a chosen
 * set of games (the ones that just ended).
 *
 * Formulas follow game.py line for line, including what it does with moves that are not legal
 * (floor division and modulo as torch's, index -1 as the last element), so that both backends
 * give the same states for any input.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
/* The OpenMP build exists to run on torch's own threads, which means GNU's runtime (libgomp,
 * what torch's Linux wheels load). Clang and Intel's compilers link another runtime (libomp,
 * libiomp5): a second set of threads beside torch's. Refusing to build here makes native.py use
 * the build with its own thread pool instead. */
#if !defined(__GNUC__) || defined(__clang__) || defined(__INTEL_COMPILER)
#error "the OpenMP build is for GCC (GNU's libgomp); build without -fopenmp"
#endif
#endif

typedef struct {
    int64_t P, C, R, H, D, MI, ML, obs, M;
    int64_t color_of[32]; /* card -> color and rank: tables, since 64-bit divisions are slow */
    int64_t rank_of[32];
} Rules;

enum {
    DECK, DEALT, HANDS, HAND_COUNT, COLOR_OK, RANK_OK, COLOR_HINT, RANK_HINT, FIREWORKS, INFO,
    LIFE, DISCARDS, PLAYER, TURNS_LEFT, OVER, LAST_KIND, LAST_PLAYER, LAST_TARGET, LAST_COLOR,
    LAST_RANK, LAST_REVEALED, LAST_SLOT, LAST_CARD, LAST_SCORED, LAST_TOKEN, NFIELDS
};

enum { PLAY, DISCARD, REVEAL_COLOR, REVEAL_RANK };

/* The state tensors' data as typed pointers. Functions copy them out of the pointer array into
 * a local struct first: read through void ** after every byte store (bytes may alias anything)
 * they would be loaded again and again. */
typedef struct {
    int64_t *deck, *dealt, *hands, *hand_count;
    uint8_t *color_ok, *rank_ok;
    int64_t *color_hint, *rank_hint, *fireworks, *info, *life, *discards, *player, *turns_left;
    uint8_t *over;
    int64_t *last_kind, *last_player, *last_target, *last_color, *last_rank;
    uint8_t *last_revealed;
    int64_t *last_slot, *last_card;
    uint8_t *last_scored, *last_token;
} State;

static inline State unpack(void **s) {
    State t = {
        s[DECK], s[DEALT], s[HANDS], s[HAND_COUNT], s[COLOR_OK], s[RANK_OK], s[COLOR_HINT],
        s[RANK_HINT], s[FIREWORKS], s[INFO], s[LIFE], s[DISCARDS], s[PLAYER], s[TURNS_LEFT],
        s[OVER], s[LAST_KIND], s[LAST_PLAYER], s[LAST_TARGET], s[LAST_COLOR], s[LAST_RANK],
        s[LAST_REVEALED], s[LAST_SLOT], s[LAST_CARD], s[LAST_SCORED], s[LAST_TOKEN],
    };
    return t;
}
/* A variant's sizes are compiled in as constants (native.py builds one library per variant,
 * defining HANABI_P, HANABI_C and the rest as the Rules fields): with the sizes known the
 * compiler unrolls and folds the loops over players, slots, colors and ranks. */
#ifndef HANABI_P
#error "build with the variant's sizes defined (-DHANABI_P=2 -DHANABI_C=5 ...), as native.py does"
#endif
#define RULE(f) HANABI_##f
#define MAX_OBS 2048 /* > the longest view: 5 players, 1,285 values with the paper's extras */
#define MAX_P 5
#define MAX_H 8
#define MAX_DECK 128 /* > the largest deck: 25 kinds of card, at most 3 copies each */

/* Copies of each card of rank k (the HLE's NumberCardInstances, HanabiRules.instances): known
 * to the compiler, which then unrolls the loops over them. */
static inline int64_t copies_of(int64_t k) { return k == 0 ? 3 : (k == RULE(R) - 1 ? 1 : 2); }

static inline int64_t fdiv(int64_t a, int64_t b) {
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

static inline int64_t fmod64(int64_t a, int64_t b) { return a - b * fdiv(a, b); }

static inline int64_t wrap(int64_t i, int64_t n) { return i < 0 ? i + n : i; }

static inline int64_t score_of(const Rules *r, State t, int64_t g) {
    if (t.life[g] <= 0) return 0;
    int64_t sum = 0;
    for (int64_t c = 0; c < RULE(C); c++) sum += t.fireworks[g * RULE(C) + c];
    return sum;
}

/* Move m of the player to act in game g, unless the game is over; returns the change of the
 * score. */
static inline float step_game(const Rules *r, State t, int64_t g, int64_t m) {
    const int64_t P = RULE(P), C = RULE(C), R = RULE(R), H = RULE(H), D = RULE(D);
    const int64_t CR = C * R;
    if (t.over[g]) return 0.0f;
    int64_t before = score_of(r, t, g);
    int64_t *fw = t.fireworks + g * C;
    int64_t *info = t.info + g, *life = t.life + g, *dealt = t.dealt + g;
    int64_t me = t.player[g];
    /* a move made with the deck already empty counts down the last round */
    if (*dealt >= D) t.turns_left[g] -= 1;
    int is_discard = m < H;
    int is_play = m >= H && m < 2 * H;
    int64_t hint = m - 2 * H;
    int is_color = hint >= 0 && hint < (P - 1) * C;
    int is_rank = hint >= (P - 1) * C;
    int64_t slot = m < H ? m : m - H;
    slot = slot < 0 ? 0 : (slot > H - 1 ? H - 1 : slot);

    /* play and discard */
    int leaves = is_discard || is_play;
    int64_t *counts = t.hand_count + g * P;
    int64_t *hand = t.hands + (g * P + me) * H;
    int64_t card = hand[slot];
    int64_t color = fdiv(card, R), rank = fmod64(card, R);
    int64_t *fw_c = fw + wrap(color, C);
    int fits = *fw_c == rank;
    int scored = is_play && fits;
    if (scored) *fw_c += 1;
    int token = (is_discard || (scored && rank == R - 1)) && *info < RULE(MI);
    *info += token;
    *life -= is_play && !fits;
    if (is_discard || (is_play && !fits)) t.discards[g * CR + wrap(card, CR)] += 1;
    if (leaves) {
        /* the cards right of the slot move one left; the deck's next card (if any) fills
         * the last slot, else the hand is one card short */
        int64_t count = counts[me];
        int has_card = *dealt < D;
        int64_t last = count - 1;
        int64_t new_card = t.deck[g * D + (*dealt < D - 1 ? *dealt : D - 1)];
        uint8_t *cok = t.color_ok + (g * P + me) * H * C;
        uint8_t *rok = t.rank_ok + (g * P + me) * H * R;
        int64_t *ch = t.color_hint + (g * P + me) * H;
        int64_t *rh = t.rank_hint + (g * P + me) * H;
        for (int64_t j = 0; j < H; j++) {
            int64_t src = j + (j >= slot);
            if (src > H - 1) src = H - 1;
            int fill = j == last && has_card;
            int empty = j >= last && !has_card;
            if (fill || empty) {
                hand[j] = fill ? new_card : -1;
                memset(cok + j * C, fill, (size_t)C);
                memset(rok + j * R, fill, (size_t)R);
                ch[j] = -1;
                rh[j] = -1;
            } else { /* src is j or j + 1: reading ahead of the writes */
                hand[j] = hand[src];
                memmove(cok + j * C, cok + src * C, (size_t)C);
                memmove(rok + j * R, rok + src * R, (size_t)R);
                ch[j] = ch[src];
                rh[j] = rh[src];
            }
        }
        if (has_card)
            *dealt += 1;
        else
            counts[me] = count - 1;
    }

    /* reveals */
    int64_t hint_rank = hint - (P - 1) * C;
    int64_t offset = (is_color ? fdiv(hint, C) : fdiv(hint_rank, R)) + 1;
    int64_t target = fmod64(me + offset, P);
    int64_t value = is_color ? fmod64(hint, C) : fmod64(hint_rank, R);
    int64_t *tcards = t.hands + (g * P + target) * H;
    int64_t tcount = counts[target];
    uint8_t *revealed = t.last_revealed + g * H;
    uint8_t *tcok = t.color_ok + (g * P + target) * H * C;
    uint8_t *trok = t.rank_ok + (g * P + target) * H * R;
    int64_t *tch = t.color_hint + (g * P + target) * H;
    int64_t *trh = t.rank_hint + (g * P + target) * H;
    for (int64_t j = 0; j < H; j++) {
        int there = j < tcount;
        int hit_color = there && is_color && r->color_of[tcards[j]] == value;
        int hit_rank = there && is_rank && r->rank_of[tcards[j]] == value;
        revealed[j] = (uint8_t)(hit_color || hit_rank);
        if (is_color && there) {
            for (int64_t c = 0; c < C; c++)
                tcok[j * C + c] = hit_color ? (c == value) : (tcok[j * C + c] && c != value);
        }
        if (hit_color) tch[j] = value;
        if (is_rank && there) {
            for (int64_t k = 0; k < R; k++)
                trok[j * R + k] = hit_rank ? (k == value) : (trok[j * R + k] && k != value);
        }
        if (hit_rank) trh[j] = value;
    }
    if (is_color || is_rank) *info -= 1;

    /* the last move, for the observation */
    t.last_kind[g] = is_play ? PLAY : is_discard ? DISCARD : is_color ? REVEAL_COLOR
                                                                         : REVEAL_RANK;
    t.last_player[g] = me;
    t.last_target[g] = target;
    t.last_color[g] = value;
    t.last_rank[g] = value;
    t.last_slot[g] = slot;
    t.last_card[g] = card;
    t.last_scored[g] = (uint8_t)scored;
    t.last_token[g] = (uint8_t)token;

    /* the next player and the end */
    t.player[g] = (me + 1) % P;
    int64_t total = 0;
    for (int64_t c = 0; c < C; c++) total += fw[c];
    if (*life <= 0 || total >= CR || t.turns_left[g] <= 0) t.over[g] = 1;
    return (float)(score_of(r, t, g) - before);
}

/* One move of the player to act in every unfinished game of the range; rewards[g] = the change
 * of the score. moves and rewards are indexed by game. */
void hanabi_step(const Rules *rules, void **s, const int64_t *ids, int64_t lo, int64_t hi,
                 const int64_t *moves, float *rewards) {
    const Rules copy = *rules, *r = &copy; /* a local copy: no reloads after byte stores */
    const State t = unpack(s);
    for (int64_t i = lo; i < hi; i++) {
        int64_t g = ids ? ids[i] : i;
        rewards[g] = step_game(r, t, g, moves[g]);
    }
}

/* The episode statistics hanabi_env_step writes, stats[k * batch + g] for k in this order (env.py's
 * stat_names). */
enum { STAT_SCORE, STAT_PERFECT, STAT_LIVES_LOST, STAT_LENGTH, STAT_DISCARDS, STAT_PLAYS,
       STAT_HINTS, NSTATS };

/* One step of the env (what HanabiEnv._step computes with the torch backend) in every game of the
 * range, of `batch` games: the move of the player to act taken from actions[g, P]; the move
 * counted by its kind (discard, play, hint) in counts[g, 3] unless the game was over, and the
 * game's length[g] counted up; the move made; every player's reward rewards[g, P] (the change of
 * the score); the episode statistics stats[NSTATS, batch] after the move. */
void hanabi_env_step(const Rules *rules, void **s, const int64_t *ids, int64_t lo, int64_t hi,
                     int64_t batch, const int64_t *actions, int64_t *length, int64_t *counts,
                     float *rewards, float *stats) {
    const Rules copy = *rules, *r = &copy; /* a local copy: no reloads after byte stores */
    const State t = unpack(s);
    const int64_t P = RULE(P), H = RULE(H), CR = RULE(C) * RULE(R);
    for (int64_t i = lo; i < hi; i++) {
        int64_t g = ids ? ids[i] : i;
        int64_t m = actions[g * P + t.player[g]];
        int64_t *count = counts + g * 3;
        if (!t.over[g]) count[(m >= H) + (m >= 2 * H)] += 1;
        length[g] += 1;
        float reward = step_game(r, t, g, m);
        for (int64_t q = 0; q < P; q++) rewards[g * P + q] = reward;
        int64_t score = score_of(r, t, g);
        stats[STAT_SCORE * batch + g] = (float)score;
        stats[STAT_PERFECT * batch + g] = (float)(score == CR);
        stats[STAT_LIVES_LOST * batch + g] = (float)(RULE(ML) - t.life[g]);
        stats[STAT_LENGTH * batch + g] = (float)length[g];
        for (int64_t k = 0; k < 3; k++) stats[(STAT_DISCARDS + k) * batch + g] = (float)count[k];
    }
}

/* The legal moves of the player to act, out[row, M] (all zero in a finished game). */
static inline void legal_of(const Rules *r, State t, int64_t g, uint8_t *out) {
    const int64_t P = RULE(P), C = RULE(C), R = RULE(R), H = RULE(H);
    memset(out, 0, (size_t)RULE(M));
    if (t.over[g]) return;
    int64_t me = t.player[g], info = t.info[g];
    int64_t count = t.hand_count[g * P + me];
    for (int64_t j = 0; j < H; j++) {
        out[j] = j < count && info < RULE(MI);
        out[H + j] = j < count;
    }
    if (info <= 0) return;
    for (int64_t o = 1; o < P; o++) {
        int64_t target = (me + o) % P;
        const int64_t *cards = t.hands + (g * P + target) * H;
        int64_t tcount = t.hand_count[g * P + target];
        for (int64_t j = 0; j < tcount && j < H; j++) {
            out[2 * H + (o - 1) * C + r->color_of[cards[j]]] = 1;
            out[2 * H + (P - 1) * C + (o - 1) * R + r->rank_of[cards[j]]] = 1;
        }
    }
}

void hanabi_legal(const Rules *rules, void **s, const int64_t *ids, int64_t lo, int64_t hi,
                  uint8_t *out) {
    const Rules copy = *rules, *r = &copy; /* a local copy: no reloads after byte stores */
    const State t = unpack(s);
    for (int64_t i = lo; i < hi; i++) legal_of(r, t, ids ? ids[i] : i, out + i * RULE(M));
}

/* Every player's observation of game g as 0/1 bytes, buf[o * width + k] (width >= the view's
 * length). belief: the knowledge section's plausible cards as the MAPPO paper code encodes them;
 * turn: a one-hot of the player to act appended (the paper code's inputs have both). */
static inline void observe_game(const Rules *r, State t, int64_t g, int belief, int turn,
                                uint8_t *buf, int64_t width) {
    const int64_t P = RULE(P), C = RULE(C), R = RULE(R), H = RULE(H), D = RULE(D);
    const int64_t CR = C * R;
    const int64_t MI = RULE(MI), ML = RULE(ML), obs = RULE(obs);
    const int64_t n = obs + (turn ? P : 0);
    for (int64_t o = 0; o < P; o++) memset(buf + o * width, 0, (size_t)n);
    const int64_t *hands = t.hands + g * P * H;
    const int64_t *counts = t.hand_count + g * P;
    int64_t at;

    /* the other players' hands (one-hot per slot) and which hands are short of a card */
    for (int64_t o = 0; o < P; o++) {
        uint8_t *row = buf + o * width;
        for (int64_t k = 1; k < P; k++) {
            int64_t seat = (o + k) % P;
            for (int64_t j = 0; j < H; j++) {
                int64_t card = hands[seat * H + j];
                if (card >= 0) row[((k - 1) * H + j) * CR + card] = 1;
            }
        }
        at = (P - 1) * H * CR;
        for (int64_t k = 0; k < P; k++) row[at + k] = counts[(o + k) % P] < H;
    }

    /* the game-wide sections, written for observer 0 and copied */
    uint8_t *row0 = buf;
    int64_t game_from = (P - 1) * H * CR + P;
    at = game_from;
    int64_t left = D - t.dealt[g];
    for (int64_t k = 0; k < D - P * H; k++) row0[at + k] = k < left;
    at += D - P * H;
    const int64_t *fw = t.fireworks + g * C;
    for (int64_t c = 0; c < C; c++)
        if (fw[c] >= 1 && fw[c] <= R) row0[at + c * R + fw[c] - 1] = 1;
    at += CR;
    const int64_t info = t.info[g], life = t.life[g];
    for (int64_t k = 0; k < MI; k++) row0[at + k] = k < info;
    at += MI;
    for (int64_t k = 0; k < ML; k++) row0[at + k] = k < life;
    at += ML;
    const int64_t *disc = t.discards + g * CR;
    for (int64_t c = 0; c < C; c++) {
        for (int64_t k = 0; k < R; k++) {
            const int64_t copies = copies_of(k), gone = disc[c * R + k];
            for (int64_t q = 0; q < copies; q++) row0[at + q] = gone > q;
            at += copies;
        }
    }
    int64_t board_to = at;

    /* the last move: the mover and the hint's target relative to each observer, the rest
     * game-wide */
    int64_t kind = t.last_kind[g];
    int has = kind >= 0, is_hint = kind == REVEAL_COLOR || kind == REVEAL_RANK;
    int leave = kind == PLAY || kind == DISCARD;
    int64_t actor_at = at;
    int64_t kind_from = at + P;
    if (kind >= 0 && kind < 4) row0[kind_from + kind] = 1;
    int64_t target_at = kind_from + 4;
    int64_t after_target = target_at + P;
    at = after_target;
    if (kind == REVEAL_COLOR) {
        int64_t v = t.last_color[g];
        if (v >= 0 && v < C) row0[at + v] = 1;
    }
    at += C;
    if (kind == REVEAL_RANK) {
        int64_t v = t.last_rank[g];
        if (v >= 0 && v < R) row0[at + v] = 1;
    }
    at += R;
    for (int64_t j = 0; j < H; j++) row0[at + j] = t.last_revealed[g * H + j] && is_hint;
    at += H;
    if (leave) {
        int64_t v = t.last_slot[g];
        if (v >= 0 && v < H) row0[at + v] = 1;
    }
    at += H;
    if (leave) {
        int64_t v = t.last_card[g];
        if (v >= 0 && v < CR) row0[at + v] = 1;
    }
    at += CR;
    /* the HLE sets the token bit for plays only (a discard's token is not encoded) */
    row0[at] = t.last_scored[g] && kind == PLAY;
    row0[at + 1] = t.last_token[g] && kind == PLAY;
    at += 2;
    int64_t game_to = at;
    for (int64_t o = 0; o < P; o++) {
        uint8_t *row = buf + o * width;
        if (o > 0) {
            memcpy(row + game_from, row0 + game_from, (size_t)(board_to - game_from));
            memcpy(row + kind_from, row0 + kind_from, 4);
            memcpy(row + after_target, row0 + after_target, (size_t)(game_to - after_target));
        }
        if (has) row[actor_at + fmod64(t.last_player[g] - o, P)] = 1;
        if (is_hint) row[target_at + fmod64(t.last_target[g] - o, P)] = 1;
    }

    /* every holder's card knowledge, once per holder, then placed from each seat on */
    const int64_t per_slot = CR + C + R;
    static const uint8_t no_rank[8] = {0};
    uint8_t know[MAX_P * MAX_H * 35];
    int64_t played_left[25];
    if (belief) { /* the copies of each card not yet discarded or played */
        for (int64_t c = 0; c < C; c++)
            for (int64_t k = 0; k < R; k++)
                played_left[c * R + k] = copies_of(k) - disc[c * R + k] - (k < fw[c]);
    }
    for (int64_t q = 0; q < P; q++) {
        for (int64_t j = 0; j < H; j++) {
            uint8_t *blk = know + (q * H + j) * per_slot;
            const uint8_t *cok = t.color_ok + ((g * P + q) * H + j) * C;
            const uint8_t *rok = t.rank_ok + ((g * P + q) * H + j) * R;
            /* color c's row is the plausible ranks or nothing: copies rather than the
             * products, which the compiler packs into vectors through the stack (stalls) */
            for (int64_t c = 0; c < C; c++) memcpy(blk + c * R, cok[c] ? rok : no_rank, R);
            if (belief) { /* the card's one-hot where the public counts determine it */
                int64_t total = 0;
                for (int64_t card = 0; card < CR; card++) total += blk[card] * played_left[card];
                for (int64_t card = 0; card < CR; card++)
                    blk[card] = total > 0 && blk[card] * played_left[card] == total;
            }
            int64_t ch = t.color_hint[(g * P + q) * H + j];
            int64_t rh = t.rank_hint[(g * P + q) * H + j];
            for (int64_t c = 0; c < C; c++) blk[CR + c] = ch == c;
            for (int64_t k = 0; k < R; k++) blk[CR + C + k] = rh == k;
        }
    }
    const int64_t know_at = game_to;
    const int64_t block = H * per_slot;
    for (int64_t o = 0; o < P; o++) {
        uint8_t *row = buf + o * width;
        for (int64_t k = 0; k < P; k++)
            memcpy(row + know_at + k * block, know + ((o + k) % P) * block, (size_t)block);
        if (turn) row[obs + t.player[g]] = 1;
    }
}

/* Every player's observation as bytes, out[row, P, width] (its first obs columns). */
void hanabi_observe(const Rules *rules, void **s, const int64_t *ids, int64_t lo, int64_t hi,
                    int belief, uint8_t *out, int64_t width) {
    const Rules copy = *rules, *r = &copy; /* a local copy: no reloads after byte stores */
    const State t = unpack(s);
    for (int64_t i = lo; i < hi; i++)
        observe_game(r, t, ids ? ids[i] : i, belief, 0, out + i * RULE(P) * width, width);
}

/* What the env returns for each game: every player's observation obs[row, P, n], the global
 * state state[row, n + H * CR] (the acting player's observation and own hand, the hand first
 * with paper), both float32, or bytes with `bytes` (a quarter of the memory written, and written
 * in place rather than converted from a buffer); the action masks mask[row, P, M] (the legal
 * moves for the player to act, move 0 alone for the others and in a finished game) and
 * alive[row, P]. */
void hanabi_views(const Rules *rules, void **s, const int64_t *ids, int64_t lo, int64_t hi,
                  int paper, int bytes, void *obs, void *state, uint8_t *mask, uint8_t *alive) {
    const Rules copy = *rules, *r = &copy; /* a local copy: no reloads after byte stores */
    const State t = unpack(s);
    const int64_t P = RULE(P), H = RULE(H), CR = RULE(C) * RULE(R), M = RULE(M);
    const int64_t n = RULE(obs) + (paper ? P : 0);
    const int64_t width = n + H * CR;
    uint8_t buf[MAX_P * MAX_OBS];
    uint8_t hand_bits[MAX_H * 25];
    uint8_t legal[64];
    for (int64_t i = lo; i < hi; i++) {
        int64_t g = ids ? ids[i] : i;
        int64_t me = t.player[g];
        memset(hand_bits, 0, (size_t)(H * CR));
        for (int64_t j = 0; j < H; j++) {
            int64_t card = t.hands[(g * P + me) * H + j];
            if (card >= 0) hand_bits[j * CR + card] = 1;
        }
        if (bytes) {
            uint8_t *o_row = (uint8_t *)obs + i * P * n;
            observe_game(r, t, g, paper, paper, o_row, n);
            uint8_t *st = (uint8_t *)state + i * width;
            memcpy(paper ? st + H * CR : st, o_row + me * n, (size_t)n);
            memcpy(paper ? st : st + n, hand_bits, (size_t)(H * CR));
        } else {
            observe_game(r, t, g, paper, paper, buf, MAX_OBS);
            float *o_row = (float *)obs + i * P * n;
            for (int64_t o = 0; o < P; o++)
                for (int64_t k = 0; k < n; k++) o_row[o * n + k] = (float)buf[o * MAX_OBS + k];
            float *st = (float *)state + i * width;
            float *view_cols = paper ? st + H * CR : st;
            float *hand_cols = paper ? st : st + n;
            for (int64_t k = 0; k < n; k++) view_cols[k] = (float)buf[me * MAX_OBS + k];
            for (int64_t k = 0; k < H * CR; k++) hand_cols[k] = (float)hand_bits[k];
        }
        int over = t.over[g];
        legal_of(r, t, g, legal);
        for (int64_t o = 0; o < P; o++) {
            int acts = o == me && !over;
            alive[i * P + o] = (uint8_t)acts;
            uint8_t *mrow = mask + (i * P + o) * M;
            if (acts) {
                memcpy(mrow, legal, (size_t)M);
            } else {
                memset(mrow, 0, (size_t)M);
                mrow[0] = 1;
            }
        }
    }
}

/* Start a new game in row g from deck[D] (what HanabiGames.reset writes). */
static inline void deal_game(State t, int64_t g, const int64_t *deck) {
    const int64_t P = RULE(P), C = RULE(C), R = RULE(R), H = RULE(H), D = RULE(D);
    const int64_t CR = C * R;
    memcpy(t.deck + g * D, deck, (size_t)D * sizeof(int64_t));
    t.dealt[g] = P * H;
    memcpy(t.hands + g * P * H, deck, (size_t)(P * H) * sizeof(int64_t));
    for (int64_t q = 0; q < P; q++) t.hand_count[g * P + q] = H;
    memset(t.color_ok + g * P * H * C, 1, (size_t)(P * H * C));
    memset(t.rank_ok + g * P * H * R, 1, (size_t)(P * H * R));
    for (int64_t k = 0; k < P * H; k++) {
        t.color_hint[g * P * H + k] = -1;
        t.rank_hint[g * P * H + k] = -1;
    }
    memset(t.fireworks + g * C, 0, (size_t)C * sizeof(int64_t));
    t.info[g] = RULE(MI);
    t.life[g] = RULE(ML);
    memset(t.discards + g * CR, 0, (size_t)CR * sizeof(int64_t));
    t.player[g] = 0;
    t.turns_left[g] = P;
    t.over[g] = 0;
    t.last_kind[g] = -1;
    t.last_player[g] = 0;
    t.last_target[g] = 0;
    t.last_color[g] = 0;
    t.last_rank[g] = 0;
    memset(t.last_revealed + g * H, 0, (size_t)H);
    t.last_slot[g] = 0;
    t.last_card[g] = 0;
    t.last_scored[g] = 0;
    t.last_token[g] = 0;
}

/* Start new games in rows ids[lo..hi) from decks[row, D]. */
void hanabi_deal(const Rules *rules, void **s, const int64_t *ids, int64_t lo, int64_t hi,
                 const int64_t *decks) {
    (void)rules;
    const State t = unpack(s);
    for (int64_t i = lo; i < hi; i++) deal_game(t, ids ? ids[i] : i, decks + i * RULE(D));
}

/* The deck order that sorting keys[D] gives (HanabiGames.shuffled_decks): the unshuffled deck
 * (every card id repeated by its number of copies, in order) permuted by the stable argsort of
 * the keys, ties kept in position order as torch's argsort(stable=True) keeps them. Each card's
 * place is counted rather than found by sorting: the keys below its own, and the equal ones
 * before it; D * D comparisons without a branch, which the compiler vectorises (several times
 * faster than an insertion sort of 50 keys, whose branches a random order defeats). */
static inline void shuffle_deck(const Rules *r, const float *keys, int64_t *deck) {
    const int64_t C = RULE(C), R = RULE(R), D = RULE(D);
    float key[MAX_DECK];
    memcpy(key, keys, (size_t)D * sizeof(float));
    int64_t i = 0;
    for (int64_t card = 0; card < C * R; card++) {
        for (int64_t q = 0; q < copies_of(r->rank_of[card]); q++, i++) {
            const float k = key[i];
            int32_t place = 0;
            for (int32_t j = 0; j < (int32_t)D; j++)
                place += (key[j] < k) | ((key[j] == k) & (j < (int32_t)i));
            deck[place] = card;
        }
    }
}

/* Shuffled decks from uniform keys[row, D] (shuffle_deck), for rows [lo, hi): written to
 * decks[row, D] where decks is given; with deal, dealt as new games in rows ids[row] (or row). */
void hanabi_shuffle(const Rules *rules, void **s, const int64_t *ids, int64_t lo, int64_t hi,
                    int deal, const float *keys, int64_t *decks) {
    const Rules copy = *rules, *r = &copy;
    const State t = deal ? unpack(s) : (State){0};
    int64_t own[MAX_DECK];
    for (int64_t i = lo; i < hi; i++) {
        int64_t *deck = decks ? decks + i * RULE(D) : own;
        shuffle_deck(r, keys + i * RULE(D), deck);
        if (deal) deal_game(t, ids ? ids[i] : i, deck);
    }
}

/* The functions above by number, on rows [lo, hi): what hanabi_run splits. Arguments a and b
 * are the integers and p0..p4 the buffers each takes, in its own order. */
enum { RUN_STEP, RUN_LEGAL, RUN_OBSERVE, RUN_VIEWS, RUN_DEAL, RUN_ENV_STEP, RUN_SHUFFLE };

static void run_rows(int fn, const Rules *r, void **s, const int64_t *ids, int64_t lo,
                     int64_t hi, int64_t a, int64_t b, void *p0, void *p1, void *p2, void *p3,
                     void *p4) {
    switch (fn) {
    case RUN_STEP: hanabi_step(r, s, ids, lo, hi, p0, p1); break;
    case RUN_LEGAL: hanabi_legal(r, s, ids, lo, hi, p0); break;
    case RUN_OBSERVE: hanabi_observe(r, s, ids, lo, hi, (int)a, p0, b); break;
    case RUN_VIEWS: hanabi_views(r, s, ids, lo, hi, (int)a, (int)b, p0, p1, p2, p3); break;
    case RUN_DEAL: hanabi_deal(r, s, ids, lo, hi, p0); break;
    case RUN_ENV_STEP: hanabi_env_step(r, s, ids, lo, hi, a, p0, p1, p2, p3, p4); break;
    case RUN_SHUFFLE: hanabi_shuffle(r, s, ids, lo, hi, (int)a, p0, p1); break;
    default: break;
    }
}

/* Whether this build splits rows between OpenMP threads (native.py builds it so where torch's
 * own OpenMP runtime, libgomp, is loaded: the two share one team of threads, which torch keeps
 * spinning between its operations, so handing rows to them costs microseconds and no second set
 * of threads competes with them for the cores). */
int hanabi_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Function fn on rows [0, rows), split evenly between `threads` OpenMP threads where the build
 * has OpenMP and threads > 1, else on this thread alone (a forked child must not enter the
 * parent's OpenMP team: native.py passes 1 there). */
void hanabi_run(int fn, int threads, const Rules *rules, void **s, const int64_t *ids,
                int64_t rows, int64_t a, int64_t b, void *p0, void *p1, void *p2, void *p3,
                void *p4) {
#ifdef _OPENMP
    if (threads > 1) {
        /* Share k of `threads` equal shares of the rows, handed out by the runtime's own loop
         * scheduling rather than computed from thread numbers (the same result for any size
         * of team the runtime grants, one thread included). */
        const int64_t n = threads;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t k = 0; k < n; k++)
            run_rows(fn, rules, s, ids, rows * k / n, rows * (k + 1) / n, a, b, p0, p1, p2, p3,
                     p4);
        return;
    }
#endif
    (void)threads;
    run_rows(fn, rules, s, ids, 0, rows, a, b, p0, p1, p2, p3, p4);
}
