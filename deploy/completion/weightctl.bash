# bash completion for weightctl (installed as
# share/bash-completion/completions/weightctl). Completes verbs, each verb's
# flags and their fixed values, file arguments, and model names asked of the
# daemon named on the line (--socket / --target), with a 2 s limit.

_weightctl_models() {
    local -a conn=()
    local i
    for ((i = 1; i < ${#COMP_WORDS[@]} - 1; i++)); do
        case "${COMP_WORDS[i]}" in
            --socket|--target|--tls-ca|--tls-cert|--tls-key|--tls-server-name|--token-file)
                conn+=("${COMP_WORDS[i]}" "${COMP_WORDS[i+1]}") ;;
        esac
    done
    timeout 2 "${COMP_WORDS[0]}" "${conn[@]}" list 2>/dev/null | cut -f1
}

_weightctl() {
    local cur prev verb sub i
    cur="${COMP_WORDS[COMP_CWORD]}"
    prev="${COMP_WORDS[COMP_CWORD-1]}"
    local global="--socket --target --tls-ca --tls-cert --tls-key --tls-server-name --token-file --retry-deadline --help"
    local verbs="health load unload list info stats verify gpus peers fetch adapter apply watch publish"

    case "$prev" in
        --socket|--tls-ca|--tls-cert|--tls-key|--token-file|--profile|--out)
            COMPREPLY=($(compgen -f -- "$cur")); compopt -o filenames 2>/dev/null; return ;;
        --dtype) COMPREPLY=($(compgen -W "keep f32 f16 bf16 f8_e4m3 f8_e5m2" -- "$cur")); return ;;
        --transport) COMPREPLY=($(compgen -W "shm grpc push cuda" -- "$cur")); return ;;
        --format) COMPREPLY=($(compgen -W "auto peft kohya dense" -- "$cur")); return ;;
        --source) COMPREPLY=($(compgen -W "auto storage peers" -- "$cur")); return ;;
        --target|--tls-server-name|--retry-deadline|--readers|--world|--rank|--mesh|--coord|\
        --placements|--generation|--changed-since|--names|--device|--count|--expect-generation)
            return ;;
    esac

    # The verb: the first word that is neither a global flag nor its value.
    verb="" sub=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${COMP_WORDS[i]}" in
            --help|--verify|--strict) ;;
            --*) ((i++)) ;;
            *) if [ -z "$verb" ]; then verb="${COMP_WORDS[i]}"
               elif [ -z "$sub" ]; then sub="${COMP_WORDS[i]}"; fi ;;
        esac
    done

    if [ -z "$verb" ]; then
        COMPREPLY=($(compgen -W "$verbs $global" -- "$cur")); return
    fi
    case "$verb" in
        load)
            if [[ "$cur" == -* ]]; then COMPREPLY=($(compgen -W "--profile --readers --source" -- "$cur"))
            elif [ -n "$sub" ]; then COMPREPLY=($(compgen -f -- "$cur")); compopt -o filenames 2>/dev/null
            fi ;;
        unload|info|verify)
            [ -z "$sub" ] && COMPREPLY=($(compgen -W "$(_weightctl_models)" -- "$cur")) ;;
        fetch)
            if [[ "$cur" == -* ]]; then
                COMPREPLY=($(compgen -W "--world --rank --mesh --coord --placements --dtype --transport --device --generation --changed-since --names --verify --out" -- "$cur"))
            elif [ -z "$sub" ]; then COMPREPLY=($(compgen -W "$(_weightctl_models)" -- "$cur"))
            fi ;;
        apply)
            if [[ "$cur" == -* ]]; then COMPREPLY=($(compgen -W "--expect-generation" -- "$cur"))
            elif [ -z "$sub" ]; then COMPREPLY=($(compgen -W "$(_weightctl_models)" -- "$cur"))
            fi ;;
        watch)
            if [[ "$cur" == -* ]]; then COMPREPLY=($(compgen -W "--count" -- "$cur"))
            elif [ -z "$sub" ]; then COMPREPLY=($(compgen -W "$(_weightctl_models)" -- "$cur"))
            fi ;;
        adapter)
            if [ -z "$sub" ]; then COMPREPLY=($(compgen -W "load list unload" -- "$cur"))
            elif [ "$sub" = load ] && [[ "$cur" == -* ]]; then
                COMPREPLY=($(compgen -W "--format --strict --readers --source" -- "$cur"))
            elif [ "$sub" = load ]; then COMPREPLY=($(compgen -f -- "$cur")); compopt -o filenames 2>/dev/null
            fi ;;
    esac
}
complete -F _weightctl weightctl
